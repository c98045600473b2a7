#!/usr/bin/env bash
# The GPU visit: every CUDA path and every GPU figure of ampflow in one command, each step time-bounded.
#
#   bench/gpu_visit.sh [--out DIR] [--only STEP,...] [--deadline SECONDS] [--quick] [--dry-run]
#
# On a CUDA machine with torch (Ray, MLflow, OmegaConf, torchvision not needed installed): installs the wheels
# carried in .whl/ (and the packs in .whl-parts/, see `make gpu-wheels`) whose packages are missing, into
# .visit-site/, then runs the steps below in order. A step that fails or runs past its time is recorded and
# the next one runs; the exit code is 1 when any step failed or was not reached, 2 when the machine has no
# CUDA device.
#
#   install, versions   always: the wheels, then DIR/versions.json (device, torch, CUDA, cuDNN, NCCL, packages)
#   cuda_tests          the tests marked `cuda` in tests/ (they skip without CUDA)  -> cuda_tests.json
#   quickstart          jobs/quickstart.yaml through the Ray-free loop under O1, O2, bf16-mixed, and under FSDP2
#                       with O2 and a float32 rule (quickstart-O1, quickstart-O2, quickstart-bf16-mixed,
#                       quickstart-fsdp; `quickstart` names all four)
#   gpu_amp policy telemetry fast_paths epoch airbench startup   python -m bench.NAME on CUDA  -> NAME.json
#   submit              the quickstart through `python -m orchestrator.submit`, when Ray and MLflow import
#                       (carried as a pack; skipped otherwise)  -> submit.json
#
# Everything lands in DIR (default out/gpu-visit): one JSON per step, logs/STEP.log, summary.json.
# --only runs the named steps (and install, versions): a visit whose commands may run 10 minutes each is
# split in parts, see docs/benchmarks.md. --deadline: the whole command ends within SECONDS, summary
# included: each step's bound is cut to the time left, and a step with too little left is recorded
# `no_time`, not started. VISIT_TIMEOUT_<STEP> (e.g. VISIT_TIMEOUT_FAST_PATHS=900) changes a step's bound
# in seconds. --quick: fewer timed rounds and a shorter airbench, for a visit of two 10-minute commands.
# --dry-run runs the same steps on the CPU with tiny sizes, with Ray and MLflow made unimportable as on the
# visit machine: the test suite runs it to prove the plumbing. Of the three quickstart presets it runs O1 alone
# (quickstart-O2 and quickstart-bf16-mixed are the same command with another preset, recorded skipped), and it
# records `epoch` and `startup` as skipped: fresh processes per run, whose smoke runs tests/test_bench.py makes.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT_DIR="out/gpu-visit"
ONLY=""
DRY_RUN=0
QUICK=0
DEADLINE=""
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }  # the comment above
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR="${2:?--out needs a folder}"; shift 2 ;;
    --out=*) OUT_DIR="${1#--out=}"; shift ;;
    --only) ONLY="${2:?--only needs step names}"; shift 2 ;;
    --only=*) ONLY="${1#--only=}"; shift ;;
    --deadline) DEADLINE="${2:?--deadline needs seconds}"; shift 2 ;;
    --deadline=*) DEADLINE="${1#--deadline=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --quick) QUICK=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1' (bench/gpu_visit.sh --help lists the options)" >&2; exit 2 ;;
  esac
done

case "$DEADLINE" in
  ""|*[!0-9]*) [ -n "$DEADLINE" ] && { echo "error: --deadline takes whole seconds, e.g. 570" >&2; exit 2; } ;;
esac
STEPS="cuda_tests quickstart-O1 quickstart-O2 quickstart-bf16-mixed quickstart-fsdp gpu_amp policy telemetry fast_paths"
STEPS="$STEPS epoch airbench startup submit"
if [ -n "$ONLY" ]; then
  for name in ${ONLY//,/ }; do
    case " $STEPS quickstart install versions " in
      *" $name "*) ;;
      *) echo "error: --only: unknown step '$name'; steps: quickstart $STEPS" >&2; exit 2 ;;
    esac
  done
fi
selected() {  # is step $1 to run?
  [ -z "$ONLY" ] && return 0
  local name
  for name in ${ONLY//,/ }; do
    [ "$name" = "$1" ] && return 0
    [ "$name" = quickstart ] && [ "${1#quickstart-}" != "$1" ] && return 0
  done
  return 1
}

if [ "$DRY_RUN" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "error: torch sees no CUDA device here ($PY). The visit is for a CUDA machine; on a CPU run" \
       "bench/gpu_visit.sh --dry-run" >&2
  exit 2
fi
mkdir -p "$OUT_DIR/logs" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOGS="$OUT_DIR/logs"
STEPS_TSV="$OUT_DIR/steps.tsv"
: > "$STEPS_TSV"
SITE="$REPO/.visit-site"
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if [ "$DRY_RUN" = 1 ]; then
  DEVICE=cpu
  # As on the visit machine: Ray and MLflow cannot be imported (a step that needs them must say so, not crash).
  ABSENT="$(mktemp -d)"
  trap 'rm -rf "$ABSENT"' EXIT
  for module in ray mlflow; do
    mkdir -p "$ABSENT/$module"
    echo "raise ImportError('$module is not installed (gpu_visit.sh --dry-run hides it, as on the visit machine)')" \
      > "$ABSENT/$module/__init__.py"
  done
  export PYTHONPATH="$ABSENT:$PYTHONPATH"
else
  DEVICE=cuda
fi

now() { date +%s.%N; }
MARGIN=20  # seconds kept for the summary, and the least a step is started with

# run_step NAME SECONDS JSON COMMAND...: run COMMAND within SECONDS (VISIT_TIMEOUT_<NAME> overrides), its
# output in logs/NAME.log, one row in steps.tsv: ok, failed (non-zero exit, or no JSON), timed_out.
run_step() {
  local name="$1" limit="$2" json="$3"
  shift 3
  local var="VISIT_TIMEOUT_$(echo "$name" | tr 'a-z.-' 'A-Z__')"
  limit="${!var:-$limit}"
  if [ -n "$DEADLINE" ]; then
    local left=$((DEADLINE - SECONDS - MARGIN))
    if [ "$left" -lt "$MARGIN" ]; then
      printf '%s\tno_time\t0\t0.0\t0\t\t%s\t%s\n' "$name" "$json" "not started: --deadline $DEADLINE s reached" \
        >> "$STEPS_TSV"
      echo "== $name: not started, --deadline $DEADLINE s reached"
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  local log="$LOGS/$name.log" started ended seconds rc status
  echo "== $name (at most ${limit}s): $*"
  started=$(now)
  timeout --kill-after=15 "$limit" "$@" > "$log" 2>&1
  rc=$?
  ended=$(now)
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    status=timed_out
  elif [ "$rc" != 0 ]; then
    status=failed
  elif [ -n "$json" ] && [ ! -s "$json" ]; then
    status=failed; rc=1; echo "no $json was written" >> "$log"
  else
    status=ok
  fi
  seconds=$(awk -v a="$started" -v b="$ended" 'BEGIN { printf "%.1f", b - a }')
  local command="$*"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$seconds" "$limit" "$log" "$json" \
    "${command//[$'\t\n']/ }" >> "$STEPS_TSV"
  echo "   $status (exit $rc) in $seconds s; last lines of $log:"
  tail -n 4 "$log" | sed 's/^/   | /'
}

skip_step() {  # NAME WHY: recorded, not run
  printf '%s\tskipped\t0\t0.0\t0\t\t\t%s\n' "$1" "$2" >> "$STEPS_TSV"
  echo "== $1: skipped: $2"
}

# Bounds in seconds: what each step takes on an H100 with room to spare (the dry run takes its own).
bound() { if [ "$DRY_RUN" = 1 ]; then echo 600; else echo "$1"; fi; }

# -- install, versions ---------------------------------------------------------------------------------------
# The dry run's Python cannot install wheels made for the visit's: it only says what it would install.
DRY=()
[ "$DRY_RUN" = 1 ] && DRY=(--check)
run_step install "$(bound 300)" "$OUT_DIR/wheels.json" "$PY" -m bench.visit_env install --wheels .whl \
  --parts .whl-parts --site "$SITE" ${DRY[@]+"${DRY[@]}"} --json "$OUT_DIR/wheels.json"
[ "$DRY_RUN" = 1 ] && DRY=(--dry-run)
run_step versions "$(bound 120)" "$OUT_DIR/versions.json" \
  "$PY" -m bench.visit_env versions ${DRY[@]+"${DRY[@]}"} --json "$OUT_DIR/versions.json"

# -- the CUDA tests --------------------------------------------------------------------------------------------
selected cuda_tests && run_step cuda_tests "$(bound 480)" "$OUT_DIR/cuda_tests.json" \
  "$PY" -m bench.visit_env cuda-tests --json "$OUT_DIR/cuda_tests.json"

# -- the quickstart through the Ray-free loop ------------------------------------------------------------------
SMOKE=()
[ "$DRY_RUN" = 1 ] && SMOKE=(--smoke)
for preset in O1 O2 bf16-mixed; do
  selected "quickstart-$preset" || continue
  if [ "$DRY_RUN" = 1 ] && [ "$preset" != O1 ]; then
    skip_step "quickstart-$preset" "dry run: the command of quickstart-O1 with --preset $preset"
    continue
  fi
  run_step "quickstart-$preset" "$(bound 240)" "$OUT_DIR/quickstart-$preset.json" \
    "$PY" -m bench.visit_quickstart --preset "$preset" --device "$DEVICE" ${SMOKE[@]+"${SMOKE[@]}"} \
    --json "$OUT_DIR/quickstart-$preset.json"
done
# FSDP2 on one rank: the plan's units, shards and per-layer dtypes, with a rule the preset does not make itself.
selected quickstart-fsdp && run_step quickstart-fsdp "$(bound 240)" "$OUT_DIR/quickstart-fsdp.json" \
  "$PY" -m bench.visit_quickstart --preset O2 --device "$DEVICE" ${SMOKE[@]+"${SMOKE[@]}"} \
  --json "$OUT_DIR/quickstart-fsdp.json" scaling.strategy=fsdp \
  'precision.rules=[{match: "classifier.*", dtype: float32}]'

# -- the harnesses ----------------------------------------------------------------------------------------------
# The dry run's sizes: --smoke and one round of one step, which is all the plumbing needs.
GPU_AMP=() POLICY=() TELEMETRY=() FAST_PATHS=() AIRBENCH=() EPOCH=()
if [ "$DRY_RUN" = 1 ]; then
  POLICY=(--smoke --repeats 1 --steps 1 --warmup 1)
  TELEMETRY=(--smoke --log-every 1 --steps 1 --repeats 1 --warmup 1)
  FAST_PATHS=(--smoke --steps 1 --warmup 1)
elif [ "$QUICK" = 1 ]; then
  GPU_AMP=(--repeats 5 --warmup 10)
  TELEMETRY=(--warmup 20)  # policy and telemetry keep their 21 rounds: the targets are read from 20 or more
  FAST_PATHS=(--steps 30 --warmup 10)
  AIRBENCH=(--epochs 3 --repeats 1)
  EPOCH=(--long 4)
fi
selected gpu_amp && run_step gpu_amp "$(bound 480)" "$OUT_DIR/gpu_amp.json" \
  "$PY" -m bench.gpu_amp ${SMOKE[@]+"${SMOKE[@]}"} ${GPU_AMP[@]+"${GPU_AMP[@]}"} --json "$OUT_DIR/gpu_amp.json"
selected policy && run_step policy "$(bound 300)" "$OUT_DIR/policy.json" \
  "$PY" -m bench.policy --device "$DEVICE" ${POLICY[@]+"${POLICY[@]}"} --json "$OUT_DIR/policy.json"
selected telemetry && run_step telemetry "$(bound 300)" "$OUT_DIR/telemetry.json" \
  "$PY" -m bench.telemetry --device "$DEVICE" --no-mlflow ${TELEMETRY[@]+"${TELEMETRY[@]}"} \
  --json "$OUT_DIR/telemetry.json"
selected fast_paths && run_step fast_paths "$(bound 540)" "$OUT_DIR/fast_paths.json" \
  "$PY" -m bench.fast_paths --device "$DEVICE" ${FAST_PATHS[@]+"${FAST_PATHS[@]}"} \
  --json "$OUT_DIR/fast_paths.json"
if selected epoch; then
  if [ "$DRY_RUN" = 1 ]; then
    skip_step epoch "dry run: fresh processes per run; tests/test_bench.py runs its smoke"
  else
    run_step epoch "$(bound 540)" "$OUT_DIR/epoch.json" \
      "$PY" -m bench.epoch --device "$DEVICE" ${EPOCH[@]+"${EPOCH[@]}"} --json "$OUT_DIR/epoch.json"
  fi
fi
selected airbench && run_step airbench "$(bound 540)" "$OUT_DIR/airbench.json" \
  "$PY" -m bench.airbench --device "$DEVICE" ${SMOKE[@]+"${SMOKE[@]}"} ${AIRBENCH[@]+"${AIRBENCH[@]}"} \
  --json "$OUT_DIR/airbench.json"

if selected startup; then
  if [ "$DRY_RUN" = 1 ]; then
    skip_step startup "dry run: fresh processes per round; tests/test_bench.py runs its smoke"
  else
    run_step startup "$(bound 300)" "$OUT_DIR/startup.json" "$PY" -m bench.startup --json "$OUT_DIR/startup.json"
  fi
fi

# -- the quickstart through submit (Ray Train + MLflow), when they were carried -----------------------------------
if selected submit; then
  if missing="$("$PY" -c 'import ray, mlflow' 2>&1)"; then
    run_step submit "$(bound 480)" "$OUT_DIR/submit.json" \
      "$PY" -m bench.visit_quickstart --through submit --preset O1 --device "$DEVICE" ${SMOKE[@]+"${SMOKE[@]}"} \
      --json "$OUT_DIR/submit.json"
  else
    skip_step submit "Ray or MLflow does not import ($(echo "$missing" | tail -n 1)); carry them: make gpu-wheels-submit"
  fi
fi

# -- the summary -------------------------------------------------------------------------------------------------
"$PY" -m bench.visit_env summary "$STEPS_TSV" ${DRY[@]+"${DRY[@]}"} --json "$OUT_DIR/summary.json" || exit 1
echo
echo "steps (DIR $OUT_DIR):"
awk -F'\t' '{ printf "  %-24s %-10s %6.1f s  %s\n", $1, $2, $4, $6 }' "$STEPS_TSV"
if awk -F'\t' '$2 != "ok" && $2 != "skipped" { bad = 1 } END { exit bad ? 0 : 1 }' "$STEPS_TSV"; then
  echo "some steps failed: see their logs in $LOGS" >&2
  exit 1
fi
echo "every step ok"

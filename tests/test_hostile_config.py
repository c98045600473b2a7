"""Hostile job files and keys: what cannot be read, a bound that is not finite, a count that would be checked one by
one, and messages that must point at the right key. Each is refused with exit 2 and one line before Ray or an
MLflow run, in time that does not depend on the numbers given; what already held (`!!python` tags, unicode keys,
every `scaling.num_workers` shape) stays held.

The command-line cases run in one fresh interpreter through each command's `main`, exactly as the CLI calls it
(`conftest.run_mains`); one runs `python -m orchestrator.submit` itself.
"""

import dataclasses
import math
import subprocess
import sys
import time
import typing

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import REPO, run_mains, small_job
from orchestrator.config import load_job, reference, schema
from orchestrator.config.loader import parse_overrides
from orchestrator.config.validate import DURATIONS
from orchestrator.config.workers import MAX_WORKERS, Workers, micro_batches, uneven_world_size
from orchestrator.config.yamlsafe import MAX_BYTES, MAX_DEPTH, MAX_NODES
from orchestrator.errors import BadInput

MARKER = "marker-created-by-a-python-tag"


def nested(levels: int) -> dict:
    """`model.kwargs` nested so that the whole job has `levels` levels of mappings (the job itself is one)."""
    value: typing.Any = 1
    for _ in range(levels - 2):  # the job and `model` are two; `kwargs` is the outermost of these
        value = {"a": value}
    return small_job(model={"name": "simple_cnn", "kwargs": value})


def binary() -> bytes:
    return bytes(range(255, -1, -1)) * 8  # 0xff first: not UTF-8 from its first byte


def deep_text(levels: int) -> str:
    return "model: {name: simple_cnn}\ndata: {name: digits}\nx: " + "[" * levels + "]" * levels + "\n"


# -- through the commands ---------------------------------------------------------------------------------------------

SUBMIT = {
    # Item 6: job files that cannot be read.
    "binary_file": (binary(), [], "not a YAML job file: byte 0 (0xff) is not UTF-8 text"),
    "deep_file": (deep_text(5000), [], f"deeper than {MAX_DEPTH} levels"),
    "large_file": ("x" * (MAX_BYTES + 1), [], "the job file is 1,048,577 bytes, more than the 1 MiB a job file may have"),
    "many_values": ("model: {name: simple_cnn}\ndata: {name: digits}\nx: [" + "1," * MAX_NODES + "1]\n", [],
                    f"more than {MAX_NODES:,} keys and values"),
    "deep_override": (small_job(), ["model.kwargs.a=" + "[" * 5000 + "]" * 5000], f"deeper than {MAX_DEPTH} levels"),
    "long_override_key": (small_job(), ["model.kwargs" + ".a" * 5000 + "=1"], "its key has 5002 parts"),
    "python_tag_in_override": (small_job(), [f"model.name=!!python/object/apply:os.system ['touch {MARKER}']"],
                               "could not determine a constructor for the tag"),
    "python_name_tag_in_kwargs": ("model: {name: simple_cnn, kwargs: {f: !!python/name:os.system}}\n"
                                  "data: {name: digits}\n", [], "not valid YAML"),
    # Item 2: a duration that is not finite, or past its bound.
    "grace_1e300": (small_job(), ["failure.preemption_grace_s=1e300"],
                    "failure.preemption_grace_s: must be a finite number of seconds > 0 and at most 3,600 (an hour)"),
    "resize_inf": (small_job(), ["scaling.resize_check_s=.inf"],
                   "scaling.resize_check_s: must be a finite number of seconds > 0 and at most 86,400 (a day), "
                   "got inf"),
    "flush_nan": (small_job(), ["tracking.flush_timeout_s=nan"], "tracking.flush_timeout_s: must be a finite number"),
    # Item 3: a count checked in time independent of its size.
    "workers_a_billion": (small_job(), ["scaling.num_workers=[1,1000000000]"],
                          f"scaling.num_workers: an elastic range's max is at most {MAX_WORKERS:,} workers"),
    "workers_fixed_a_billion": (small_job(), ["scaling.num_workers=1000000000"],
                                f"scaling.num_workers: must be at most {MAX_WORKERS:,} workers"),
    # Item 8: messages that point at the key.
    "rule_unknown_key": (small_job(), ['precision.rules=[{match: "features.*", dtype: float32, foo: 1}]'],
                         "unknown key 'foo' in precision.rules[0] (match 'features.*'). Allowed keys in each entry of "
                         "precision.rules: match, dtype, checkpoint, compile, scaling."),
    "rule_key_named_like_a_section": (
        small_job(precision={"rules": [{"match": "classifier", "dtype": "float32"},
                                       {"match": "features.*", "dtype": "float32", "perf": 1}]}), [],
        "unknown key 'perf' in precision.rules[1] (match 'features.*'). Allowed keys in each entry of "
        "precision.rules: match, dtype, checkpoint, compile, scaling."),
    "rule_value_of_the_wrong_type": (
        small_job(), ['precision.rules=[{match: a, dtype: float32, scaling: rowwise}, {match: b, dtype: float32, '
                      'scaling: [1]}]'], "key 'scaling' of precision.rules[1] (match 'b'): Cannot convert"),
    "metric_unknown_key": (small_job(task={"metrics": [{"name": "accuracy", "log": "acc"}]}), [],
                           "unknown key 'log' in task.metrics[0] (name 'accuracy'). Did you mean 'log_as'?"),
    "model_loss_not_taken": (small_job(task={"loss": "model"}), [],
                             "task.loss: model: model.name simple_cnn does not take the targets as `labels`"),
    # Unicode keys: named as written, with the nearest key.
    "unicode_section": ("modèl: {name: simple_cnn}\ndata: {name: digits}\n", [],
                        "unknown section 'modèl'. Did you mean 'model'?"),
    "unicode_key": (small_job(run={"nàme": "x"}), [], "unknown key 'run.nàme'. Did you mean 'run.name'?"),
    "unicode_run_name": (small_job(run={"name": "日本"}), [], "run.name: '日本' is not a safe run name"),
}


def write(path, job) -> None:
    if isinstance(job, bytes):
        path.write_bytes(job)
    else:
        path.write_text(job if isinstance(job, str) else yaml.safe_dump(job, allow_unicode=True))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hostile-config")
    (workdir / "jobs").mkdir()
    argvs = {}
    for name, (job, overrides, _) in SUBMIT.items():
        path = workdir / "jobs" / f"{name}.yaml"
        write(path, job)
        argvs[name] = [str(path), *overrides, f"data.root={workdir / 'data'}"]
    started = time.monotonic()
    results = run_mains("orchestrator.cli.submit", argvs, workdir)
    results["seconds"] = time.monotonic() - started
    results["marker"] = (workdir / MARKER).exists()
    return results


@pytest.mark.parametrize("name", SUBMIT)
def test_submit_refuses_it_with_exit_2_and_one_line_naming_what_and_where_before_anything_starts(outcomes, name):
    result = outcomes[name]
    assert result["rc"] == 2, result["stderr"]
    assert result["stderr"].startswith("error: ") and result["stderr"].count("\n") == 1, result["stderr"]
    assert SUBMIT[name][2] in result["stderr"], result["stderr"]
    assert "Traceback" not in result["stderr"] and "MLflow run" not in result["stderr"]
    assert not result["ray"], "Ray must not be started for bad input"
    assert result["files"] == ["jobs"], "no mlflow.db, ray_results or data may be left behind"


def test_none_of_it_takes_long_or_runs_the_tag(outcomes):
    assert not outcomes["marker"], "a !!python tag on the command line must never run"
    # A billion workers were checked one count at a time (minutes); a 5,000-deep file overflowed the stack.
    assert outcomes["seconds"] < 60, f"{len(SUBMIT)} refusals took {outcomes['seconds']:.0f} s"


def test_the_command_itself_exits_2_on_a_binary_job_file_without_a_driver_failure(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_bytes(binary())
    out = subprocess.run([sys.executable, "-m", "orchestrator.submit", str(job)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [f"error: {job}: not a YAML job file: byte 0 (0xff) is not UTF-8 text. Give the "
                                       "job's YAML file (UTF-8 text), not a binary file."]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


@pytest.mark.parametrize("module, flags", [("orchestrator.cli.sweep", ["--presets", "O0,O1"]),
                                           ("orchestrator.cli.tune", ["--output", "tuned.yaml"])])
def test_sweep_and_tune_refuse_the_same_files_with_exit_2(tmp_path, module, flags):
    jobs = {"binary": binary(), "deep": deep_text(5000), "large": "x" * (MAX_BYTES + 1)}
    for name, job in jobs.items():
        write(tmp_path / f"{name}.yaml", job)
    results = run_mains(module, {name: [str(tmp_path / f"{name}.yaml"), *flags] for name in jobs}, tmp_path)
    for name, expected in (("binary", "is not UTF-8 text"), ("deep", f"deeper than {MAX_DEPTH} levels"),
                           ("large", "more than the 1 MiB a job file may have")):
        assert results[name]["rc"] == 2, (name, results[name]["stderr"])
        assert results[name]["stderr"].startswith("error: ") and expected in results[name]["stderr"], name
        assert not results[name]["ray"]
    assert "tuned.yaml" not in results["binary"]["files"]


# -- the limits a file is read under ----------------------------------------------------------------------------------

def test_a_40_mb_job_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.yaml"
    with path.open("wb") as stream:
        stream.truncate(40 * 1024 * 1024)  # sparse: nothing to parse but its size
    started = time.monotonic()
    with pytest.raises(BadInput, match=r"huge.yaml: the job file is 40.0 MiB, more than the 1 MiB"):
        load_job(path)
    assert time.monotonic() - started < 1


def test_the_limits_are_far_above_a_real_job_and_exact_at_the_edge(write_job):
    # A thousand class names and a third-party model's config eight levels deep load as they are.
    names = [f"class_{i}" for i in range(1000)]
    cfg = load_job(write_job(small_job(data={"name": "digits", "kwargs": {"classes": names}})))
    assert list(cfg.data.kwargs.classes) == names
    assert load_job(write_job(nested(MAX_DEPTH))).model.kwargs is not None
    with pytest.raises(BadInput, match=rf"line \d+: refused as a job file: it nests mappings and lists deeper than "
                                       rf"{MAX_DEPTH} levels"):
        load_job(write_job(nested(MAX_DEPTH + 1)))
    with pytest.raises(BadInput, match=f"deeper than {MAX_DEPTH} levels"):
        parse_overrides(["model.kwargs.x=" + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)])
    parse_overrides(["model.kwargs.x=" + "[" * MAX_DEPTH + "]" * MAX_DEPTH])
    with pytest.raises(BadInput, match="more than the 1 MiB a value may have"):
        parse_overrides(["model.kwargs.x=" + "a" * (MAX_BYTES + 1)])


def test_the_limits_are_stated_in_the_docs():
    text = " ".join((REPO / "docs" / "reliability.md").read_text().split())
    for limit in (f"at most {MAX_BYTES // 1024 // 1024} MiB", f"at most {MAX_NODES:,} keys and values",
                  f"at most {MAX_DEPTH} levels", f"at most {MAX_WORKERS:,} workers"):
        assert limit in text, f"the job-file limit {limit} is not in the docs"


# -- durations: every one finite and bounded -----------------------------------------------------------------------

def _duration_keys(cls: type = schema.JobConfig, prefix: str = "") -> list[str]:
    """Every key of the schema whose name says it is in seconds (`..._s`)."""
    found = []
    for name, annotation in typing.get_type_hints(cls).items():
        inner = [a for a in (annotation, *typing.get_args(annotation)) if dataclasses.is_dataclass(a)]
        if inner:
            found += _duration_keys(inner[0], f"{prefix}{name}.")
        elif name.endswith("_s"):
            found.append(f"{prefix}{name}")
    return found


def test_every_duration_key_has_a_finite_bound_stated_in_its_doc_line():
    assert sorted(_duration_keys()) == sorted(DURATIONS), "a duration key without its range in validate.DURATIONS"
    docs = {key.name: key.doc for key in reference.keys()}
    for key, seconds in DURATIONS.items():
        assert math.isfinite(seconds.high)
        assert f"{seconds.high:,g}" in docs[key], f"{key}'s doc line does not state its bound {seconds.high:,g}"


@pytest.mark.parametrize("key", sorted(DURATIONS))
def test_a_duration_that_is_not_finite_or_past_its_bound_is_refused_naming_the_key_and_the_bound(write_job, key):
    job = write_job(small_job())
    high = DURATIONS[key].high
    assert OmegaConf.select(load_job(job, [f"{key}={high:g}"]), key) == high  # the bound itself is allowed
    for value in (".inf", "-.inf", ".nan", "inf", "nan", "1e300", f"{high * 2:g}", f"{high + 1:g}"):
        with pytest.raises(BadInput) as info:
            load_job(job, [f"{key}={value}"])
        assert f"job.yaml: {key}: must be " in str(info.value), value
        assert f"at most {high:,g}" in str(info.value), value


# -- scaling.num_workers: every shape, any size --------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [
    ("1", (1, 1, False)), ("[1,1]", (1, 1, True)), ("[2,5]", (2, 5, True)), (f"{MAX_WORKERS}", None),
    (f"[1,{MAX_WORKERS}]", (1, MAX_WORKERS, True)),
])
def test_every_count_shape_that_works_loads(write_job, value, expected):
    cfg = load_job(write_job(small_job()), [f"scaling.num_workers={value}"])
    workers = Workers.of(cfg.scaling)
    assert (workers.min, workers.max, workers.elastic) == (expected or (MAX_WORKERS, MAX_WORKERS, False))


@pytest.mark.parametrize("value, problem", [
    ("true", "a number of workers, or an elastic range [min, max], got True"),
    ("2.5", "a number of workers, or an elastic range [min, max], got 2.5"),
    ("null", "a number of workers, or an elastic range [min, max], got None"),
    ("{min: 1, max: 2}", "a number of workers, or an elastic range [min, max]"),
    ("[]", "two whole numbers [min, max], got []"),
    ("[2]", "two whole numbers [min, max], got [2]"),
    ("[1.5,2]", "two whole numbers [min, max], got [1.5, 2]"),
    ("[1,true]", "two whole numbers [min, max], got [1, True]"),
    ("[[1],[2]]", "two whole numbers [min, max]"),
    ("[-1,2]", "needs 1 <= min <= max, got [-1, 2]"),
    ("-3", "must be >= 1, got -3"),
    (f"{MAX_WORKERS + 1}", f"must be at most {MAX_WORKERS:,} workers"),
    (f"[{MAX_WORKERS + 1},{MAX_WORKERS + 1}]", f"an elastic range's max is at most {MAX_WORKERS:,} workers"),
    ("[" + ",".join(["1"] * 500) + "]", "two whole numbers [min, max], got a list of 500 values."),
])
def test_every_count_shape_that_cannot_work_is_refused_naming_the_key(write_job, value, problem):
    with pytest.raises(BadInput) as info:
        load_job(write_job(small_job()), [f"scaling.num_workers={value}"])
    assert "job.yaml: scaling.num_workers: " in str(info.value) and problem in str(info.value), str(info.value)


def test_a_huge_range_is_checked_in_a_moment(write_job):
    job = write_job(small_job(run={"batch_size": 1, "accumulate_steps": 720720}))
    started = time.monotonic()
    for value in ("[1,1000000000]", f"[1,{MAX_WORKERS}]", f"[{MAX_WORKERS // 2},{MAX_WORKERS}]"):
        with pytest.raises(BadInput, match="scaling.num_workers"):
            load_job(job, [f"scaling.num_workers={value}"])
    # 1..16 all divide 720720 x 16: a range of 16 counts that all fit one-sample micro-batches.
    assert Workers.of(load_job(job, ["scaling.num_workers=[1,16]"]).scaling).max == 16
    assert time.monotonic() - started < 2


def test_the_closed_form_check_finds_the_count_the_count_by_count_one_found():
    def count_by_count(low, high, batch_size, accumulate_steps):
        for world_size in range(low, high + 1):
            if world_size * micro_batches(accumulate_steps, high, world_size) > batch_size * accumulate_steps * high:
                return world_size
        return None

    for accumulate_steps in range(1, 9):
        for batch_size in (1, 2, 3):
            for high in range(1, 30):
                for low in range(1, high + 1):
                    assert uneven_world_size(low, high, batch_size, accumulate_steps) == \
                        count_by_count(low, high, batch_size, accumulate_steps), (low, high, batch_size,
                                                                                 accumulate_steps)


# -- unicode ---------------------------------------------------------------------------------------------------------

def test_unicode_keys_and_values_of_open_sections_are_kept_as_written(write_job):
    cfg = load_job(write_job(small_job(model={"name": "simple_cnn", "kwargs": {"größe": "日本", "ключ": 1}})))
    assert dict(cfg.model.kwargs) == {"größe": "日本", "ключ": 1}

# Two entry points, both self-contained on a fresh clone:
#   make run   -> create .venv if missing, install, train jobs/quickstart.yaml on local Ray
#   make test  -> same set-up, then the whole test suite (as CI runs it)
#   make test-fast -> the tests that start no Ray and train in no process of their own, for the inner loop
# and the GPU visit (docs/benchmarks.md, "The GPU visit"):
#   make gpu-wheels         -> .whl/: wheels the visit needs beside torch (a machine with internet makes them)
#   make gpu-wheels-submit  -> .whl-parts/: Ray, MLflow and what they need, packed in parts, for its submit step
#   make gpu-check          -> bench/gpu_visit.sh on a CUDA machine (GPU_CHECK_ARGS=--dry-run on a CPU)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
JOB    ?= jobs/quickstart.yaml
# Test files run side by side, each whole in one test process (its module fixtures built once); how many
# processes: AMPFLOW_TEST_WORKERS, else one more than the cores, as memory allows (tests/conftest.py). The files
# are handed out longest first, in the order tests/suite_order.py collects them (--no-loadscope-reorder).
# The slowest tests and files are listed after every run: the suite has a time budget (README, "Tests and their
# budget").
PYTEST_ARGS ?= -n auto --dist loadscope --no-loadscope-reorder --durations=40
# Re-install only when the project's metadata changed.
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast install clean gpu-wheels gpu-wheels-submit gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m orchestrator.submit $(JOB)

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) mlflow.db mlruns ray_results .pytest_cache

# -- the GPU visit ---------------------------------------------------------------------------------------------
# The visit machine: CPython $(VISIT_PYTHON) on x86_64 Linux with torch (2.11: torchvision 0.26.0 belongs to it;
# PyPI's is built for CUDA 13, so the torch there must be a CUDA 13 build too) and no network.
VISIT_PYTHON      ?= 3.12
VISIT_TORCHVISION ?= 0.26.0
VISIT_DOWNLOAD     = $(PYTHON) -m pip download --only-binary=:all: --python-version $(VISIT_PYTHON) \
                     --implementation cp --abi cp$(subst .,,$(VISIT_PYTHON)) --platform manylinux_2_28_x86_64 \
                     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any
# Installed on the visit machine already: not carried (the install step skips any installed package anyway).
VISIT_HAS         ?= numpy scipy scikit_learn joblib threadpoolctl matplotlib pillow fonttools kiwisolver contourpy \
                     cycler pyparsing python_dateutil six packaging pyarrow pyyaml psutil jinja2 markupsafe filelock \
                     fsspec typing_extensions
GPU_PYTHON        ?= python3
GPU_OUT           ?= out/gpu-visit

gpu-wheels:
	$(VISIT_DOWNLOAD) --no-deps -d .whl 'omegaconf>=2.4,<2.5' 'torchvision==$(VISIT_TORCHVISION)' nvidia-ml-py
	@ls -l .whl

gpu-wheels-submit:
	rm -rf .whl-submit
	$(VISIT_DOWNLOAD) -d .whl-submit 'ray[default,train]==2.60.*' 'mlflow>=3,<4'
	for name in $(VISIT_HAS); do find .whl-submit -iname "$$name-*.whl" -delete; done
	$(PYTHON) -m bench.visit_env pack .whl-submit --parts .whl-parts --name submit

gpu-check:
	PYTHON=$(GPU_PYTHON) bash bench/gpu_visit.sh --out $(GPU_OUT) $(GPU_CHECK_ARGS)

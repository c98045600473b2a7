# Two entry points, both self-contained on a fresh clone:
#   make run   -> create .venv if missing, install, train jobs/quickstart.yaml on local Ray
#   make test  -> same set-up, then the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
JOB    ?= jobs/quickstart.yaml
# Re-install only when the project's metadata changed.
STAMP  := $(VENV)/.installed

.PHONY: run test install clean

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

clean:
	rm -rf $(VENV) mlflow.db mlruns ray_results .pytest_cache

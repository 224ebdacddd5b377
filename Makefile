# Two entry points for a new user; each creates .venv with python3 if missing and installs the project into it.
#   make demo   - run the main job on the embedded default experiment (experiments/demo.yaml)
#   make test   - run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.servelab-installed

.PHONY: demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/servelab run experiments/demo.yaml

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/servelab bench

clean:
	rm -rf $(VENV) reports/*/ .pytest_cache

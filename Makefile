# Two entry points for a new user; each creates .venv with python3 if missing and installs the project into it.
#   make demo   - run the main job on the embedded default experiment (experiments/demo.yaml)
#   make test   - run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.servelab-installed

.PHONY: demo test bench clean bytecode

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The project's bytecode, written as pip writes it for a wheel install (an editable install writes none, and with
# PYTHONDONTWRITEBYTECODE set every process would compile the ~640 kB of source it imports: ~0.35 s a process).
# compileall skips the files whose bytecode is up to date, so this costs ~0.1 s when nothing changed.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q lab policies

demo: bytecode
	$(BIN)/servelab run experiments/demo.yaml

test: bytecode
	$(BIN)/python -m pytest

bench: bytecode
	$(BIN)/servelab bench

clean:
	rm -rf $(VENV) reports/*/ .pytest_cache

# Two entry points for a new user; each creates .venv with python3 if missing and installs the project into it.
#   make demo   - run the main job on the embedded default experiment (experiments/demo.yaml)
#   make test   - run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.servelab-installed
NATIVE := $(VENV)/.servelab-native

.PHONY: demo test calibration-checks composition bench clean bytecode

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -m pip install --quiet --upgrade pip
	SERVELAB_PURE_PYTHON=1 $(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The hot core (setup.py's HOT_CORE) compiled with mypyc, ~60 s: once after the install above, and again when one of
# its sources changes (an editable install does not rebuild it; lab/core/native.py then runs the sources, and says so).
$(NATIVE): $(STAMP) lab/core/request.py lab/core/batch.py lab/core/kv_cache.py lab/costmodel/roofline.py $(wildcard lab/engine/jump/*.py)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(NATIVE)

# The project's bytecode, written as pip writes it for a wheel install (an editable install writes none, and with
# PYTHONDONTWRITEBYTECODE set every process would compile the ~640 kB of source it imports: ~0.35 s a process).
# compileall skips the files whose bytecode is up to date, so this costs ~0.1 s when nothing changed.
bytecode: $(NATIVE)
	$(BIN)/python -m compileall -q lab policies

demo: bytecode
	$(BIN)/servelab run experiments/demo.yaml

# With the hot core compiled, the tests that patch its functions to watch them skip; they run again on its sources.
# The slow cost-model accuracy checks (about a minute each) run in their own target, which CI runs as well.
test: bytecode
	$(BIN)/python -m pytest -m "not calibration_check"
	@if $(BIN)/python -c "import sys, lab.core.native as n; sys.exit(0 if n.compiled_modules() else 1)"; then \
	  echo "SERVELAB_PURE_PYTHON=1: the tests that watch the hot core, on its sources"; \
	  SERVELAB_PURE_PYTHON=1 $(BIN)/python -m pytest -m instruments_core; fi

calibration-checks: bytecode
	$(BIN)/python -m pytest -m calibration_check

# The long composition run (make test runs a short profile of it: tests/test_composition_property.py): 5,000 seeded
# feature combinations, each run with fast-forward on and off against the invariants of tests/composition.py; prints
# ok / refused by reason / failed by class, writes one reproducer per failure class to /tmp/composition_failures,
# exits 1 on any failure.
COMPOSITION_DRAWS ?= 5000
COMPOSITION_JOBS ?= 2
composition: bytecode
	$(BIN)/python bench/composition_run.py $(COMPOSITION_DRAWS) --jobs $(COMPOSITION_JOBS)

bench: bytecode
	$(BIN)/servelab bench

clean:
	rm -rf $(VENV) reports/*/ .pytest_cache

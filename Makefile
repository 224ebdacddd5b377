# Two entry points for a new user; each creates .venv with python3 if missing and installs the project into it.
#   make demo   - run the main job on the embedded default experiment (experiments/demo.yaml)
#   make test   - run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.servelab-installed
NATIVE := $(VENV)/.servelab-native

.PHONY: demo test calibration-checks composition bench clean bytecode parity

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -m pip install --quiet --upgrade pip
	SERVELAB_PURE_PYTHON=1 $(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The hot core (setup.py's HOT_CORE) compiled with mypyc, ~60 s: once after the install above, and again when one of
# its sources changes (an editable install does not rebuild it; lab/core/native.py then runs the sources, and says so).
$(NATIVE): $(STAMP) lab/core/request.py lab/core/batch.py lab/core/kv_cache.py lab/core/outputs.py lab/core/speculation.py lab/costmodel/roofline.py $(wildcard lab/engine/jump/*.py)
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

# vLLM parity (issue 43, docs/vllm_parity.md): vLLM 0.33.0's own scheduler beside servelab's vllm_v1 policy, step for
# step, on PARITY_TRACES random traces, then the hypothesis property test over random settings and traces. Its own
# environment, .venv-parity, CPU only: PyTorch's CPU build (PARITY_TORCH; here a wheel on this machine's disk, elsewhere
# add PyTorch's CPU wheel index with PARITY_PIP_ARGS), vLLM and xgrammar without their GPU dependencies (--no-deps),
# the pinned list of what its scheduler imports (parity/requirements.txt), servelab itself. Any failure, the
# install's included, fails the target (the property test does not skip there: PARITY_REQUIRED=1).
PARITY_VENV := .venv-parity
PARITY_STAMP := $(PARITY_VENV)/.parity-installed
PARITY_TORCH ?= torch==2.13.0+cpu
PARITY_PIP_ARGS ?=
PARITY_TRACES ?= 1000
PARITY_EXAMPLES ?= 100

$(PARITY_STAMP): parity/requirements.txt pyproject.toml setup.py
	rm -rf $(PARITY_VENV)
	$(PYTHON) -m venv $(PARITY_VENV)
	$(PARITY_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PARITY_VENV)/bin/python -m pip install --quiet $(PARITY_PIP_ARGS) '$(PARITY_TORCH)'
	$(PARITY_VENV)/bin/python -m pip install --quiet --no-deps vllm==0.33.0 xgrammar==0.2.8
	$(PARITY_VENV)/bin/python -m pip install --quiet $(PARITY_PIP_ARGS) -r parity/requirements.txt
	SERVELAB_PURE_PYTHON=1 $(PARITY_VENV)/bin/python -m pip install --quiet -e .
	touch $(PARITY_STAMP)

parity: $(PARITY_STAMP)
	SERVELAB_PURE_PYTHON=1 $(PARITY_VENV)/bin/python -m parity --traces $(PARITY_TRACES) --seed 0 --keep-going --known
	SERVELAB_PURE_PYTHON=1 PARITY_REQUIRED=1 PARITY_EXAMPLES=$(PARITY_EXAMPLES) $(PARITY_VENV)/bin/python -m pytest -p no:cacheprovider \
	  tests/test_vllm_parity.py

bench: bytecode
	$(BIN)/servelab bench

clean:
	rm -rf $(VENV) reports/*/ .pytest_cache

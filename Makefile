# fairseq-specdec developer commands.  `make install` creates .venv; `make test`
# installs first when needed, then runs the whole test suite (slow end-to-end
# tests included, as CI does).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo gec-demo gpu-kit clean-venv

install: $(STAMP)

# the C++ extension (fairseq_specdec/kernels/csrc) is compiled by the editable install
$(STAMP): setup.py $(wildcard fairseq_specdec/kernels/csrc/*.cpp fairseq_specdec/kernels/csrc/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install torch==2.13.0 cython numpy
	$(BIN)/pip install --no-build-isolation -e '.[test]'
	touch $(STAMP)

# the suite runs on two processes (pytest-xdist, one test file per process at
# a time, the longest files first: tests/conftest.py; the toy models are
# trained once for both); the fairseq commands of the tests run in forks of a
# process that has imported torch and fairseq once (tests/zygote.py;
# SPECDEC_TESTS_FORK=0 makes each a new process: docs/architecture.md)
TEST_JOBS ?= 2

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -v --durations=15 -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder tests

test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -v -m "not slow" -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder tests

# CTranslate2 for the demo's comparison row (the plugin never needs it);
# torch stays pinned
CT2_STAMP := $(VENV)/.ctranslate2
$(CT2_STAMP): $(STAMP)
	$(BIN)/pip install ctranslate2 torch==2.13.0
	touch $(CT2_STAMP)

# Multi30k EN-DE CPU recipe end to end (see the README for its measured
# duration on 2 cores): data, verifier, distillation, drafters, averaging,
# then the benchmark table with a CTranslate2 row.
demo: install $(CT2_STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/run-multi30k.sh

# input-guided aggressive decoding on a GEC-style corpus made from Multi30k
gec-demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/run-gec-demo.sh

# the GPU kit (.gpu-kit): the wheels a bare GPU machine lacks and the prepared
# data, for scripts/gpu-run.sh there (docs/gpu.md); KIT_ARGS: more options of
# scripts/gpu-kit.sh, e.g. KIT_ARGS="--models runs/multi30k.en-de --half-weights"
gpu-kit: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/gpu-kit.sh $(KIT_ARGS)

clean-venv:
	rm -rf $(VENV)

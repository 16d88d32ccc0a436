# fairseq-specdec developer commands.  `make install` creates .venv; `make test`
# installs first when needed, then runs the whole test suite (slow end-to-end
# tests included, as CI does).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast clean-venv

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install torch==2.13.0 cython numpy
	$(BIN)/pip install --no-build-isolation -e '.[test]'
	touch $(STAMP)

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -v tests

test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -v -m "not slow" tests

clean-venv:
	rm -rf $(VENV)

# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test test-sweep test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "Python 3.11 is needed (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/heterog demo

# serial: on two cores two pytest-xdist workers measured no faster, as the local-run tests,
# which must not overlap, are most of the time
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not sweep" --durations=25 tests

# the slow tests CI leaves out for its budget: the demo test (~110 s; `make demo` runs the same)
test-sweep: $(STAMP)
	$(BIN)/python -m pytest -q -m sweep tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: $(STAMP)
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

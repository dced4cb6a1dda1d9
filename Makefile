# The two commands a new user needs: `make train` and `make test`. Each sets itself up.
PY := .venv/bin/python
TRAIN_ARGS ?=
# the suite on 2 workers (pytest-xdist), a test file at a time, the longest files first
# (tests/conftest.py); JOBS=0 runs it in this process
JOBS ?= 2
XDIST := $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS) --dist loadfile --no-loadscope-reorder)

.PHONY: setup train test test-fast lint bench-store bench-data bench-throughput bench-fault-timing clean

setup:
	@bash scripts/setup.sh

train: setup
	$(PY) -m recsys train --out runs/main $(TRAIN_ARGS)

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q $(XDIST)

# unit and single-server tests (about a minute and a half here): before every commit
test-fast: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q $(XDIST) -m "unit or redis"

lint: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench-store: setup
	$(PY) scripts/bench_store.py

bench-data: setup
	$(PY) scripts/bench_data.py

bench-throughput: setup
	$(PY) scripts/bench_throughput.py

bench-fault-timing: setup
	$(PY) scripts/bench_fault_timing.py

clean:
	rm -rf .venv runs

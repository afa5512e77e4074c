# The two commands of the README. Both set up everything on a fresh machine (as root).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean
setup:
	bash scripts/bootstrap.sh

demo: setup
	$(VENV)/bin/moetrace demo --out demo-out

test: setup
	PY=$(PY) bash scripts/test.sh

bench: setup
	$(PY) tests/bench/run_all.py

clean:
	rm -rf demo-out .pytest_cache

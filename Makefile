# `make test` and `make demo` set up everything they need: a virtual environment in .venv with
# the CPU build of torch (from the local wheel) and this project installed in editable mode.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0

.PHONY: test demo install bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	bash scripts/lab_deps.sh
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/p2pnet devnet

bench: $(STAMP)
	$(PY) benchmarks/bench_gossip.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info

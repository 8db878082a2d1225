# `make test` and `make demo` set up everything they need: a virtual environment in .venv with
# the CPU build of torch (from the local wheel) and this project installed in editable mode.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0

.PHONY: test demo install bench clean test-transformers-lowest sim-accel

install: $(STAMP)

# the first install takes about 2-3 minutes (torch alone is about 200 MB); pip shows its progress
$(STAMP): pyproject.toml
	@echo "== setting up $(VENV) (first time only: about 2-3 minutes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== 1/2 installing $(TORCH) (CPU build)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar on $(TORCH)
	@echo "== 2/2 installing p2pnet and its dependencies (libp2p, transformers, ...)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar on -e '.[test]'
	touch $(STAMP)
	@echo "== $(VENV) is ready"

test: $(STAMP)
	bash scripts/lab_deps.sh
	bash scripts/ops_deps.sh
	$(PY) -m pytest -q

# the model tests against the lowest transformers pyproject.toml allows (the venv keeps the highest)
test-transformers-lowest: $(STAMP)
	bash scripts/test_transformers_bounds.sh

demo: $(STAMP)
	$(VENV)/bin/p2pnet devnet

bench: $(STAMP)
	$(PY) benchmarks/bench_gossip.py

# the simulator's optional C module (simulations/accel.py): fair share and event queue; the same results, faster big runs
sim-accel: $(STAMP)
	$(PY) -m simulations.accel

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info simulations/_cfairshare*.so

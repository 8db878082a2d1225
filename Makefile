# `make test` and `make demo` set up everything they need: a virtual environment in .venv with
# the CPU build of torch (from the local wheel) and this project installed in editable mode.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0
ACCEL_STAMP := $(VENV)/.sim-accel-stamp
ACCEL_SOURCES := $(wildcard simulations/_c*.c) simulations/fairshare.py simulations/accel.py p2pnet/cbuild.py
VERIFY_ACCEL_STAMP := $(VENV)/.verify-accel-stamp
VERIFY_ACCEL_SOURCES := verify/_ctopk.c verify/accel.py p2pnet/cbuild.py

.PHONY: test demo install bench clean test-transformers-lowest sim-accel verify-accel

install: $(STAMP) $(ACCEL_STAMP) $(VERIFY_ACCEL_STAMP)

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

# the suite on TEST_WORKERS pytest-xdist processes, one per core of the 2-core CI machine (0: in this
# process, as a plain `pytest` runs it). --dist loadfile gives each worker whole test files, which
# it runs in their order, so a module-scoped fixture is set up once, as in one process; the files
# go out in collection order (--no-loadscope-reorder), which keeps the few long single-test files
# from all coming last
TEST_WORKERS ?= 2

test: $(STAMP) $(ACCEL_STAMP) $(VERIFY_ACCEL_STAMP)
	bash scripts/lab_deps.sh
	bash scripts/ops_deps.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# the model tests against the lowest transformers pyproject.toml allows (the venv keeps the highest)
test-transformers-lowest: $(STAMP)
	bash scripts/test_transformers_bounds.sh

demo: $(STAMP)
	$(VENV)/bin/p2pnet devnet

bench: $(STAMP)
	$(PY) benchmarks/bench_gossip.py

# the simulator's optional C fair share and event queue (simulations/accel.py): the same results,
# big runs about 1.5-2x faster. `make install` builds it where a C compiler is and goes on without
# it where not (the simulator then runs in Python); rebuilt when its sources change, and tried
# again at the next `make` after a failed build (a compiler installed since is then used)
$(ACCEL_STAMP): $(STAMP) $(ACCEL_SOURCES)
	$(PY) -m simulations.accel && touch $@ || echo "== the simulator's optional C accelerator was not built (see above); the simulator runs in Python: the same results, slower"

sim-accel: $(STAMP)
	$(PY) -m simulations.accel

# the verifier's optional C top-k (verify/accel.py): torch.topk's positions for TOPLOC chunks on
# torch's heap path, without torch; proofs and verdicts are the same bytes, selection faster.
# Built like the simulator's (see above); without it verify.topk selects with numpy and torch
$(VERIFY_ACCEL_STAMP): $(STAMP) $(VERIFY_ACCEL_SOURCES)
	$(PY) -m verify.accel && touch $@ || echo "== the verifier's optional C top-k was not built (see above); TOPLOC proofs use numpy and torch: the same bytes, slower"

verify-accel: $(STAMP)
	$(PY) -m verify.accel

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info simulations/_cfairshare*.so verify/_ctopk*.so

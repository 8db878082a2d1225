"""Shared test settings: one torch thread per process (this machine has 2 cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from tests.lab_fixtures import lab_factory  # noqa: E402,F401  (the network lab fixture)
from tests.port_fixtures import reserve_port  # noqa: E402,F401  (a port named before anyone listens)


def pytest_report_header() -> str:
    """Which fair share the simulator tests run (the C one where `make sim-accel` built it)."""
    from simulations.hostile import fair_share_implementation

    return f"simulator fair share: {fair_share_implementation()}"

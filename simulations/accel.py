"""Builds the simulator's optional C accelerator: `simulations/_cfairshare.c`, the data plane's
max-min fair sharing (`simulations.fairshare.share`) with the same float operations in the same
order, and `simulations/_cqueue.c`, the engine's event queue (the same pop order), in one module,
so a run gives the same bytes either way, faster (see BENCHMARKS.md's simulator section).

`python -m simulations.accel` (or `make sim-accel`) compiles it next to this file with the C
compiler Python was built with (`sysconfig`'s CC, else `cc`), against this interpreter's headers;
nothing is downloaded and nothing else changes. Without it (no compiler, another interpreter)
the simulator runs the Python function, as before. `P2PNET_SIM_PURE=1` makes a process ignore a
built accelerator (for A/B runs). This module only builds; it must not be imported by a run.

The module carries a stamp (`fairshare.stamp()`: the C sources and `python_share`'s source, hashed)
and the simulator uses it only while the stamp still matches, so a stale build is never run. It is
built by `p2pnet.cbuild` (shared with the verifier's module): only on x86_64 / aarch64 Linux and
macOS, where doubles are plain IEEE binary64 (no x87 excess precision), written under a temporary
name and then moved into place.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from p2pnet import cbuild

with warnings.catch_warnings():  # a stale build, about to be replaced, need not be reported
    warnings.simplefilter("ignore")
    from simulations.fairshare import stamp

SOURCE = Path(__file__).with_name("_cfairshare.c")
SOURCES = [SOURCE, SOURCE.with_name("_cqueue.c")]  # one module: the fair share and the event queue
MODULE = "_cfairshare"
# -ffp-contract=off: no fused multiply-add, every product and sum rounded as Python rounds it
FLAGS = ["-O2", "-ffp-contract=off", "-fno-fast-math", "-Wall", "-Werror"]


def target(directory: Path | None = None) -> Path:
    """Where the built module goes: `directory` (default: the `simulations` package) / its name."""
    return cbuild.target(directory or SOURCE.parent, MODULE)


def build(directory: Path | None = None, with_stamp: str | None = None) -> Path:
    """Compile the accelerator into `directory`; returns its path. Raises `RuntimeError` (with
    the compiler's output) when the compiler fails, is missing or takes over two minutes, or on a
    platform whose float arithmetic could differ from Python's (see the top)."""
    return cbuild.build(SOURCES, MODULE, directory or SOURCE.parent, with_stamp or stamp(), FLAGS)


if __name__ == "__main__":
    print(f"built {build()}")
    sys.exit(0)

"""Builds the simulator's optional C accelerator: `simulations/_cfairshare.c`, the data plane's
max-min fair sharing (`simulations.fairshare.share`) with the same float operations in the same
order, so a run gives the same bytes either way, faster (see BENCHMARKS.md's simulator section).

`python -m simulations.accel` (or `make sim-accel`) compiles it next to this file with the C
compiler Python was built with (`sysconfig`'s CC, else `cc`), against this interpreter's headers;
nothing is downloaded and nothing else changes. Without it (no compiler, another interpreter)
the simulator runs the Python function, as before. `P2PNET_SIM_PURE=1` makes a process ignore a
built accelerator (for A/B runs). This module only builds; it must not be imported by a run.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

SOURCE = Path(__file__).with_name("_cfairshare.c")
MODULE = "_cfairshare"
# -ffp-contract=off: no fused multiply-add, every product and sum rounded as Python rounds it
FLAGS = ["-O2", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared"]


def target(directory: Path | None = None) -> Path:
    """Where the built module goes: `directory` (default: the `simulations` package) / its name."""
    return (directory or SOURCE.parent) / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def build(directory: Path | None = None) -> Path:
    """Compile the accelerator into `directory`; returns its path. Raises `RuntimeError` (with
    the compiler's output) when the compiler fails or is missing."""
    out = target(directory)
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")[:1] or ["cc"]
    command = [*compiler, *FLAGS, "-I", sysconfig.get_paths()["include"], str(SOURCE), "-o", str(out)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except OSError as exc:
        raise RuntimeError(f"no C compiler to build {SOURCE.name}: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} failed:\n{' '.join(command)}\n{done.stderr}")
    return out


if __name__ == "__main__":
    print(f"built {build()}")
    sys.exit(0)

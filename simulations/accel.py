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
built only on x86_64 / aarch64 Linux and macOS, where doubles are plain IEEE binary64 (no x87
excess precision), written under a temporary name and then moved into place.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

with warnings.catch_warnings():  # a stale build, about to be replaced, need not be reported
    warnings.simplefilter("ignore")
    from simulations.fairshare import stamp

SOURCE = Path(__file__).with_name("_cfairshare.c")
SOURCES = [SOURCE, SOURCE.with_name("_cqueue.c")]  # one module: the fair share and the event queue
MODULE = "_cfairshare"
# -ffp-contract=off: no fused multiply-add, every product and sum rounded as Python rounds it
FLAGS = ["-O2", "-ffp-contract=off", "-fno-fast-math", "-Wall", "-Werror", "-fPIC", "-shared"]
PLATFORMS = {("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "x86_64"), ("darwin", "arm64")}


def compiler() -> list[str]:
    """The C compiler command: the one Python was built with (`sysconfig`'s CC), else `cc`."""
    return shlex.split(sysconfig.get_config_var("CC") or "cc")[:1] or ["cc"]


def target(directory: Path | None = None) -> Path:
    """Where the built module goes: `directory` (default: the `simulations` package) / its name."""
    return (directory or SOURCE.parent) / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))


def build(directory: Path | None = None, with_stamp: str | None = None) -> Path:
    """Compile the accelerator into `directory`; returns its path. Raises `RuntimeError` (with
    the compiler's output) when the compiler fails, is missing or takes over two minutes, or on a
    platform whose float arithmetic could differ from Python's (see the top)."""
    where = (sys.platform, platform.machine())
    if where not in PLATFORMS:
        raise RuntimeError(f"{SOURCE.name} is built only on {sorted(PLATFORMS)}, not on {where}: "
                           "its floats could round otherwise than Python's")
    out = target(directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    extra = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
    command = [*compiler(), *FLAGS, *extra, f'-DP2PNET_STAMP="{with_stamp or stamp()}"', "-I",
               sysconfig.get_paths()["include"], *map(str, SOURCES), "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except OSError as exc:
        raise RuntimeError(f"no C compiler to build {SOURCE.name}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"building {SOURCE.name} took over {exc.timeout} s:\n{' '.join(command)}") from exc
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building {SOURCE.name} failed:\n{' '.join(command)}\n{done.stderr}")
    os.replace(partial, out)  # a run importing it meanwhile sees the old file or the new one, whole
    return out


if __name__ == "__main__":
    print(f"built {build()}")
    sys.exit(0)

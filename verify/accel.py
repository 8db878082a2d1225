"""Builds the verifier's optional C module: `verify/_ctopk.c`, torch.topk's choice of the k largest
|bf16| entries for rows where torch's CPU kernel runs a heap (k * 64 <= n), the same positions in
the same order without torch (see `verify.topk`, which uses it, and BENCHMARKS.md's TOPLOC section),
the proofs' interpolation over GF(65497) (`verify.toploc._prove`: the same polynomials as
`verify.gf`), and what `verify.toploc.measure` computes from a proof (the committed polynomial's
values, as `verify.gf.evaluate`, and each chunk's statistics, as `verify.toploc._stats`).

`python -m verify.accel` (or `make install`) compiles it next to this file with the C compiler
Python was built with, against this interpreter's headers (`p2pnet.cbuild`, shared with the
simulator's module); nothing is downloaded. It is built only on Linux (`PLATFORMS`: the
libstdc++ heap torch runs there). Without it (no compiler, another platform or interpreter)
`verify.topk` selects with numpy and torch.topk, as before: the same positions.
`P2PNET_VERIFY_PURE=1` makes a process ignore a built module (A/B runs, tests of the numpy path).
The module carries `stamp()` (its C source, hashed) and is used only while that still matches.
This module only builds; a run imports `stamp` and nothing else from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from p2pnet import cbuild

SOURCE = Path(__file__).with_name("_ctopk.c")
MODULE = "_ctopk"
# -O3 for the vectorised block maxima and evaluation; no -ffast-math (the evaluation's doubles are exact
# integers only under IEEE rounding, as compiled by default)
FLAGS = ["-O3", "-Wall", "-Werror"]
# Linux only: torch's CPU wheels there are built with libstdc++, whose partial_sort the module
# replays; macOS's torch uses libc++, whose heap breaks ties otherwise
PLATFORMS = {("linux", "x86_64"), ("linux", "aarch64")}


def stamp() -> str:
    """What a built module must carry to be used: sha256 of `_ctopk.c`."""
    return cbuild.digest([SOURCE])


def build(directory: Path | None = None, with_stamp: str | None = None) -> Path:
    """Compile `_ctopk` into `directory` (default: the `verify` package); returns its path. Raises
    `RuntimeError` (with the compiler's output) where it cannot be built (`p2pnet.cbuild.build`)."""
    return cbuild.build([SOURCE], MODULE, directory or SOURCE.parent, with_stamp or stamp(), FLAGS, PLATFORMS)


if __name__ == "__main__":
    try:
        print(f"built {build()}")
    except RuntimeError as exc:  # no compiler, no headers, another platform: make goes on without it
        sys.exit(f"verify/_ctopk.c not built: {exc}")

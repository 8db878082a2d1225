"""The C top-k (`verify/_ctopk.c`) picks torch.topk's positions, in torch's order, on rows where
torch's CPU kernel runs its heap (n >= 64 k), and `verify.topk` uses it only when built from this
tree and not turned off.

Built here into a temporary folder with this interpreter's compiler (`verify.accel`), so the test
runs wherever a run could use it. The reference is what toploc runs: ``bits.view(bfloat16).abs()
.topk(k)``, on tie-heavy rows (bf16 of normal values at a small scale, rows of a handful of
values), with zeros, infinities and NaNs of several patterns and signs. The same rows tell apart
mutants of the C source (libstdc++'s heap with one detail changed), so they do exercise the
details replicated.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import verify
from p2pnet import cbuild
from verify import accel, topk

torch.set_num_threads(1)


def _build(directory: Path, source: str | None = None, with_stamp: str | None = None) -> Any:
    """The module built into `directory` (from `source`, a mutated copy of the C text, if given)."""
    if (reason := cbuild.unbuildable(accel.PLATFORMS)) is not None:
        pytest.skip(reason)
    if source is not None:
        (directory / accel.SOURCE.name).write_text(source)
        path = cbuild.build([directory / accel.SOURCE.name], accel.MODULE, directory, "mutant", accel.FLAGS,
                            accel.PLATFORMS)
    else:
        path = accel.build(directory, with_stamp)
    return cbuild.import_file(path, accel.MODULE)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _build(tmp_path_factory.mktemp("ctopk"))


def _bits(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _rows(rng: np.random.Generator, rows: int, n: int, kind: int) -> np.ndarray:
    """uint16 bf16 patterns [rows, n] of one of six kinds (five tie-heavy)."""
    shape = (rows, n)
    if kind == 0:  # bf16 of normal values at a small scale: few distinct |values| at the top
        return _bits(rng.standard_normal(shape) * 1e-3)
    if kind == 1:  # a handful of values, both signs, zeros
        return _bits(rng.choice([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, -2.0], size=shape))
    if kind == 2:  # quarter steps of normal values: long ties across the whole row
        return _bits(np.round(rng.standard_normal(shape) * 4) / 4)
    if kind == 3:  # infinities and NaNs of every sign and several payloads among normal values
        bits = _bits(rng.standard_normal(shape))
        for pattern, count in ((0x7F80, 40), (0xFF80, 40), (0x7FC0, 20), (0xFFC0, 10), (0x7F81, 5), (0xFFFF, 5)):
            bits[np.arange(rows)[:, None], rng.integers(0, n, (rows, count))] = pattern
        return bits
    if kind == 4:  # mostly zeros, a few ties above them
        values = np.zeros(shape)
        values[np.arange(rows)[:, None], rng.integers(0, n, (rows, 200))] = rng.choice([1.0, -1.0, 3.0], (rows, 200))
        return _bits(values)
    values = rng.standard_normal(shape)  # massive channels, as real LM-head inputs have: few ties at the top
    values[:, :: n // 16] *= 30.0
    return _bits(values)


def _torch(bits: np.ndarray, k: int) -> np.ndarray:
    """toploc's choice: torch.topk of the |bf16| values (NaN compared as NaN, not as a pattern)."""
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).abs().topk(k, dim=1).indices.numpy()


def _cases() -> list[tuple[np.ndarray, int]]:
    """About 3,800 rows: n from 8,192 (64 k) to 163,840 (32 tokens at hidden 5120), k = 128 and
    a few small k (an odd heap length, a heap of one)."""
    rng = np.random.default_rng(14)
    cases = []
    for n, rows in ((8192, 200), (8193, 100), (12345, 100), (65536, 30), (163840, 10)):
        for kind in range(6):
            cases.append((_rows(rng, rows, n, kind), 128))
    for k in (1, 2, 3, 77, 127):
        for kind in range(6):
            cases.append((_rows(rng, 40, 64 * k + int(rng.integers(0, 500)), kind), k))
    return cases


CASES = _cases()


def _mismatches(module: Any) -> int:
    bad = 0
    for bits, k in CASES:
        out = np.empty((bits.shape[0], k), dtype=np.int64)
        module.topk(bits, k, out)
        bad += int((out != _torch(bits, k)).any(axis=1).sum())
    return bad


def test_positions_and_order_are_torch_topks(built: Any) -> None:
    assert sum(bits.shape[0] for bits, _ in CASES) > 3000
    assert _mismatches(built) == 0


MUTANTS = {  # one detail of libstdc++'s partial_sort each
    "no even-length tail case": [("if ((len & 1) == 0 && child == (len - 2) / 2) {", "if (0) {")],
    "comp(i, first) as >=": [("if (key > least) {", "if (key >= least) {"),
                             ("found += key_of(bits[start + i]) > least;", "found += key_of(bits[start + i]) >= least;"),
                             ("if (block_max(bits + start, count) <= least)", "if (block_max(bits + start, count) < least)")],
    "the other child on equal keys": [("child -= heap[child].key > heap[child - 1].key;",
                                       "child -= heap[child].key >= heap[child - 1].key;")],
    "push up past equal keys": [("heap[parent].key > value.key", "heap[parent].key >= value.key")],
    "no NaN key": [("return key > NAN_KEY ? NAN_KEY : key;", "return key;")],
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_rows_tell_a_mutant_apart(mutant: str, tmp_path: Path) -> None:
    source = accel.SOURCE.read_text()
    for old, new in MUTANTS[mutant]:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    assert _mismatches(_build(tmp_path, source)) > 0


def test_rows_torch_would_not_heap_are_refused(built: Any) -> None:
    bits = _rows(np.random.default_rng(1), 2, 8191, 0)
    with pytest.raises(ValueError, match="64 k <= n"):
        built.topk(bits, 128, np.empty((2, 128), dtype=np.int64))
    with pytest.raises(ValueError, match="out must be"):
        built.topk(bits, 64, np.empty((2, 128), dtype=np.int64))


def test_topk_uses_a_build_only_with_the_trees_stamp(built: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def install(module: Any) -> Any:  # as if `make install` had put it in the package
        monkeypatch.setitem(sys.modules, "verify._ctopk", module)
        monkeypatch.setattr(verify, "_ctopk", module, raising=False)
        return cbuild.load("verify", "_ctopk", accel.stamp, "P2PNET_VERIFY_PURE", "make install")

    monkeypatch.delenv("P2PNET_VERIFY_PURE", raising=False)
    assert built.STAMP == accel.stamp()
    assert install(built) is built
    with pytest.warns(RuntimeWarning, match="built from another"):
        assert install(_build(tmp_path, with_stamp="0" * 64)) is None
    monkeypatch.setenv("P2PNET_VERIFY_PURE", "1")
    assert install(built) is None


@pytest.mark.parametrize("parts", [[(1, 65536)], [(1, 8192)], [(3, 65536), (2, 65536)], [(4, 4096)]])
def test_topk_of_is_the_same_with_and_without_the_module(built: Any, parts: list[tuple[int, int]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunk alone, several parts, and rows below 64 k (torch.topk either way): the same
    entries (and bit patterns) as the numpy path, in torch's order."""
    rng = np.random.default_rng(7)
    arrays = [_rows(rng, rows, n, kind) for kind in (0, 3) for rows, n in parts]
    for group in (arrays[: len(parts)], arrays[len(parts):]):
        monkeypatch.setattr(topk, "ACCELERATOR", built)
        with_c = topk.topk_of(group, 128)
        monkeypatch.setattr(topk, "ACCELERATOR", None)
        without = topk.topk_of(group, 128)
        if group[0].shape[1] >= 64 * 128:  # the C module's: torch's positions in torch's order
            assert np.array_equal(with_c[0], np.concatenate([_torch(p, 128) for p in group]))
        for idx, bits in (with_c, without):  # the numpy path's order is its own: the same sets
            order = np.argsort(idx, axis=1)
            idx[:], bits[:] = np.take_along_axis(idx, order, axis=1), np.take_along_axis(bits, order, axis=1)
        assert np.array_equal(with_c[0], without[0]) and np.array_equal(with_c[1], without[1])

"""One long chunk proven alone goes straight to the heap replay of torch.topk's CPU partial sort:
these cases make the replay's bounds tight (an entry one pattern above the bound after blocks 3
and 12 must still enter the heap) and take k below 128, where the replay keeps fewer picks. Each
asserts the set torch.topk picks on the flattened |values|, alone and batched."""
import numpy as np
import pytest
import torch

from verify.topk import topk_chunks

pytestmark = pytest.mark.usefixtures("topk_path")  # with and without verify's C module (conftest)

HIDDEN, ROWS, BLOCK = 5120, 32, 2048


def _chunk(entries: dict[int, int]) -> torch.Tensor:
    """32 x 5120 bf16: 128 distinct |values| 0x4000 + 4u, one per group of block 0 (so the first
    bound, the 128th largest group maximum of blocks 0-2, is exactly the heap's least value),
    1.0 elsewhere, and ``entries`` (flat position -> bf16 bit pattern)."""
    bits = np.full(ROWS * HIDDEN, 0x3F80, dtype=np.uint16)
    bits[:128] = 0x4000 + 4 * np.arange(128)
    for pos, pattern in entries.items():
        bits[pos] = pattern
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(ROWS, HIDDEN)


TIGHT = {
    # first stretch: right after the head, just above the first bound, then its tie (negative)
    "first": {3 * BLOCK: 0x4001, 30 * BLOCK: 0xC001},
    # second stretch: one in block 5, one at the start of block 12 just above the second bound
    "second": {5 * BLOCK + 7: 0x4001, 12 * BLOCK: 0x4002, 30 * BLOCK + 3: 0x4002},
}


def _torch_set(hidden: torch.Tensor, k: int) -> list[int]:
    return sorted(hidden.reshape(-1).abs().topk(k).indices.tolist())


@pytest.mark.parametrize("name", list(TIGHT))
def test_entry_just_above_a_tight_bound_is_replayed(name):
    hidden = _chunk(TIGHT[name])
    expected = _torch_set(hidden, 128)
    alone, _ = topk_chunks(hidden, 0, 1, ROWS, 128)
    assert sorted(alone[0].tolist()) == expected
    both, _ = topk_chunks(torch.cat([hidden, hidden]), 0, 2, ROWS, 128)
    assert [sorted(r) for r in both.tolist()] == [expected, expected]


@pytest.mark.parametrize("topk", [1, 2, 17, 64])
def test_small_topk_on_one_long_tied_chunk_alone(topk):
    gen = torch.Generator().manual_seed(topk)
    tied = (torch.randn(32, 2048, generator=gen) * 4).round().to(torch.bfloat16)  # hundreds tied per value
    for hidden in (tied, torch.full((32, 2048), -0.5, dtype=torch.bfloat16)):
        idx, _ = topk_chunks(hidden, 0, 1, 32, topk)
        assert sorted(idx[0].tolist()) == _torch_set(hidden, topk)


def _count_torch_topk(monkeypatch) -> list[int]:
    """Counts verify.topk's torch.topk calls (the shortcut without a tie must make none), on the
    numpy path (the C module, where built, runs torch's heap itself and never calls torch.topk)."""
    import verify.topk as topk_module

    monkeypatch.setattr(topk_module, "ACCELERATOR", None)
    calls, real = [], topk_module._torch_topk
    monkeypatch.setattr(topk_module, "_torch_topk", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("case", ["unique", "tie_outside_the_subsequence", "tie_at_the_kth_place"])
def test_one_long_chunk_alone_without_a_tie_skips_torch_topk(monkeypatch, case):
    """Without a tie at the subsequence's k-th place the k largest are taken directly, no torch.topk:
    a unique top 128 (block 0's distinct values); a tie in the chunk whose second entry, in a
    later block, equals the replay's bound and so never enters torch's heap (the set is still
    unique in the subsequence, and torch picks it); and a real tie at the 128th place (two
    entries of blocks 3-11 equal to the 128th largest, both entering the heap: a third in block 25
    would not, the bound there being that value), where torch must choose."""
    entries = {
        "unique": {},
        "tie_outside_the_subsequence": {20 * BLOCK + 5: 0xC000},  # |value| = block 0's least
        "tie_at_the_kth_place": {4 * BLOCK + 9: 0x4001, 9 * BLOCK + 1: 0xC001},  # 128th and 129th
    }[case]
    hidden = _chunk(entries)
    expected = _torch_set(hidden, 128)
    calls = _count_torch_topk(monkeypatch)
    idx, _ = topk_chunks(hidden, 0, 1, ROWS, 128)
    assert sorted(idx[0].tolist()) == expected
    assert len(calls) == (1 if case == "tie_at_the_kth_place" else 0)

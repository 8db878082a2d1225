"""Benchmark verify.toploc against toploc 0.1.6 (when installed) on one CPU thread.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_toploc.py [--repeats 15]

Per hidden size: build and verify time of one 32-token chunk, and verify time of 1024
tokens (32 chunks). Times are medians over repeats, in ms; inputs are random bf16.
toploc's C++ verify spawns one std::thread per hardware thread regardless of
torch.set_num_threads, so its verify figures use every core; ours use one.
Prints a markdown table (benchmarks/results/toploc.md holds a copy).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from verify.toploc import build_proofs, measure

SIZES = (896, 2048, 4096, 5120)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    try:
        import toploc
    except ImportError:
        toploc = None
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"1 torch thread, toploc {'0.1.6' if toploc else 'not installed'}\n")
    head = "| hidden | build chunk | verify chunk | verify 1024 tok |"
    sep = "|---|---|---|---|"
    if toploc:
        head += " toploc build | toploc verify chunk | toploc verify 1024 | ratio build | ratio verify 1024 |"
        sep += "---|---|---|---|---|"
    print(head + "\n" + sep)
    for hidden_size in SIZES:
        h = torch.randn(1024, hidden_size, generator=gen).to(torch.bfloat16)
        chunk = h[:32]
        proofs = build_proofs(h)
        row = [
            median_ms(lambda: build_proofs(chunk), args.repeats),
            median_ms(lambda: measure(chunk, proofs[:1]), args.repeats),
            median_ms(lambda: measure(h, proofs), max(3, args.repeats // 3)),
        ]
        line = f"| {hidden_size} | " + " | ".join(f"{x:.3f}" for x in row) + " |"
        if toploc:
            rows = [h[i : i + 1] for i in range(32)]
            tl = [
                median_ms(lambda: toploc.build_proofs_bytes(rows, 32, 128, skip_prefill=True),
                          args.repeats),
                median_ms(lambda: toploc.verify_proofs_bytes(chunk, proofs[:1], 32, 128,
                                                             skip_prefill=True), args.repeats),
                median_ms(lambda: toploc.verify_proofs_bytes(h, proofs, 32, 128,
                                                             skip_prefill=True),
                          max(3, args.repeats // 3)),
            ]
            line += " " + " | ".join(f"{x:.3f}" for x in tl)
            line += f" | {row[0] / tl[0]:.2f} | {row[2] / tl[2]:.2f} |"
        print(line)


if __name__ == "__main__":
    main()

"""Benchmark verify.toploc against toploc 0.1.6 in the same run, on one CPU thread.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_toploc.py --toploc-path DIR [--repeats 15] [--json]

toploc is never a dependency of p2pnet: ``--toploc-path`` names a folder where it was built
(its prebuilt wheel does not load with torch 2.13; build the wheel's sources with
``python setup.py build_ext --inplace``). Without it only our figures are printed.

What is timed, as a worker and a validator use it: building the proof of one 32-token chunk
(a worker proves each chunk as it is generated), building the proofs of 1,024 tokens, and
verifying 1,024 tokens (32 chunks, what a validator does per rollout). Inputs: standard
normal bf16 hidden states (tie-heavy: most chunks have equal |values| at the 128th place)
and the same with a few massive channels, as real LM-head inputs have. Both libraries run
alternately in one loop, so load on this shared machine hits both alike; times are medians.
Every chunk's proof is compared byte for byte. toploc's C++ verify starts one thread per
hardware thread whatever torch.set_num_threads says, so its verify uses every core; ours one.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from verify.testing import bf16_gaussian
from verify.toploc import build_proofs, measure

SIZES = (576, 896, 2048, 4096, 5120)


def paired_ms(fns: list, repeats: int) -> list[float]:
    """Median ms of each callable, run alternately ``repeats`` times after one warm-up."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return [1e3 * statistics.median(t) for t in times]


def bench_one(toploc, hidden_size: int, massive: int, repeats: int) -> dict:
    h = bf16_gaussian(hidden_size, 1024, hidden_size, massive_channels=massive)
    chunk = h[:32]
    ours = build_proofs(h)
    row = {"hidden": hidden_size, "massive_channels": massive, "chunks": len(ours)}
    fns = {
        "build_chunk": lambda: build_proofs(chunk),
        "build_1024": lambda: build_proofs(h),
        "verify_1024": lambda: measure(h, ours),
    }
    if toploc is None:
        for name, fn in fns.items():
            row[name] = paired_ms([fn], repeats if name == "build_chunk" else max(3, repeats // 3))[0]
        return row
    rows_chunk = [chunk[i : i + 1] for i in range(32)]
    rows_all = [h[i : i + 1] for i in range(1024)]
    theirs = toploc.build_proofs_bytes(rows_all, 32, 128, skip_prefill=True)
    row["byte_equal_chunks"] = sum(a == b for a, b in zip(ours, theirs))
    their_fns = {
        "build_chunk": lambda: toploc.build_proofs_bytes(rows_chunk, 32, 128, skip_prefill=True),
        "build_1024": lambda: toploc.build_proofs_bytes(rows_all, 32, 128, skip_prefill=True),
        "verify_1024": lambda: toploc.verify_proofs_bytes(h, theirs, 32, 128, skip_prefill=True),
    }
    for name, fn in fns.items():
        n = repeats if name == "build_chunk" else max(3, repeats // 3)
        row[name], row[f"toploc_{name}"] = paired_ms([fn, their_fns[name]], n)
        row[f"speedup_{name}"] = row[f"toploc_{name}"] / row[name]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toploc-path", default=None, help="folder holding a built toploc package")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs per figure (a third for 1024 tokens)")
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="hidden sizes")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = ap.parse_args()
    torch.set_num_threads(1)
    toploc = None
    if args.toploc_path:
        sys.path.insert(0, args.toploc_path)
        import toploc  # noqa: F811  (optional baseline, never a dependency)
    results = []
    for massive in (0, 8):
        for size in args.sizes:
            results.append(bench_one(toploc, size, massive, args.repeats))
            if not args.json:
                print(f"# hidden {size}, massive channels {massive}: done", file=sys.stderr, flush=True)
    meta = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "toploc": getattr(toploc, "__version__", None), "repeats": args.repeats}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=1))
        return
    print(f"torch {meta['torch']}, {meta['cpu']}, 1 torch thread, toploc {meta['toploc'] or 'not given'}\n")
    cols = ["build_chunk", "build_1024", "verify_1024"]
    head = "| hidden | massive ch. | " + " | ".join(f"ours {c}" for c in cols)
    sep = "|---|---|" + "---|" * len(cols)
    if toploc is not None:
        head += " | " + " | ".join(f"toploc {c}" for c in cols) + " | " + \
            " | ".join(f"x {c}" for c in cols) + " | byte-equal chunks"
        sep += "---|" * (2 * len(cols) + 1)
    print(head + " |\n" + sep)
    for r in results:
        cells = [str(r["hidden"]), str(r["massive_channels"])] + [f"{r[c]:.3f}" for c in cols]
        if toploc is not None:
            cells += [f"{r['toploc_' + c]:.3f}" for c in cols] + [f"{r['speedup_' + c]:.2f}" for c in cols]
            cells.append(f"{r['byte_equal_chunks']}/{r['chunks']}")
        print("| " + " | ".join(cells) + " |")
    print("\nTimes in ms (medians); x = toploc time / ours (above 1: ours is faster).")


if __name__ == "__main__":
    main()

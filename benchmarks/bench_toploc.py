"""Benchmark verify.toploc against toploc 0.1.6 in the same run, on one CPU thread.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_toploc.py --toploc-path DIR [--repeats 15] [--ab] [--json]

toploc is never a dependency of p2pnet: ``--toploc-path`` names a folder where it was built
(its prebuilt wheel does not load with torch 2.13; build its v0.1.6 sources with
``python setup.py build_ext --inplace`` or ``pip install --no-deps --no-build-isolation
--target DIR .``). Without it only our figures are printed.

What is timed, as a worker and a validator use it:
- ``build_chunk``: the proof of one 32-token chunk alone (a worker that proved each chunk
  the moment it was generated would pay this per chunk), per chunk over the 32 chunks of the
  1,024-token rollout, each proven alone in turn (tied and untied chunks alike);
- ``build_batch``: the proofs of a generation batch, ``--batch-rows`` rollouts of
  ``--batch-tokens`` tokens each, divided by its chunk count. This is how this project's
  worker builds them: ``trainer.rollout.build_row_proofs`` proves every row of a batch when
  the batch ends, with ``build_proofs_many`` (all rows' chunks in one pass); toploc has no
  such call, so its figure is ``build_proofs_bytes`` once per row, as a worker using it would;
- ``build_1024``: the proofs of one 1,024-token rollout;
- ``verify_1024``: verifying 1,024 tokens (32 chunks, what a validator does per rollout) with
  ``measure``'s exact tie rule (torch's choice among entries tied at the 128th place, as
  toploc): what a validator runs with tables measured with exact ties, or where no pair of
  its tables judges a submission;
- ``verify_open_1024``: the same with open ties (``exact_ties=False``): what a validator with
  the shipped calibration tables runs (measured with ``scripts/calibrate.py --ties open``). Both of ours and
  toploc's verify run alternately in one loop, and both ratios use that toploc figure.

Our top-k runs verify.topk's C module where it is built (``make install``; the header says
which); ``--ab`` adds a table of build_chunk and verify_1024 with it and without it (the numpy
path, as under ``P2PNET_VERIFY_PURE=1``), alternately in one loop.

Inputs: standard normal bf16 hidden states (tie-heavy: most chunks have equal |values| at the 128th place)
and the same with a few massive channels, as real LM-head inputs have. Both libraries run
alternately in one loop, so load on this shared machine hits both alike; times are medians.
Every chunk's proof is compared byte for byte (the 1,024-token rollout's chunks built together
and each built alone, and the batch's). toploc's C++ verify starts one thread per
hardware thread whatever torch.set_num_threads says, so its verify uses every core and ours
one; ``--one-core`` pins the whole process to one CPU so both run on one core (the issue's
"one thread" comparison).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
import types

import torch

from verify import topk as topk_module
from verify.testing import bf16_gaussian
from verify.toploc import build_proofs, build_proofs_many, measure

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


COLUMNS = ("build_chunk", "build_batch", "build_1024", "verify_1024", "verify_open_1024")


def bench_one(toploc, hidden_size: int, massive: int, repeats: int, batch_rows: int, batch_tokens: int,
              only: tuple[str, ...] = COLUMNS) -> dict:
    h = bf16_gaussian(hidden_size, 1024, hidden_size, massive_channels=massive)
    chunks = [h[i : i + 32] for i in range(0, 1024, 32)]
    batch = [bf16_gaussian(hidden_size * 1000 + r, batch_tokens, hidden_size, massive_channels=massive)
             for r in range(batch_rows)]
    batch_chunks = batch_rows * -(-batch_tokens // 32)
    ours = build_proofs(h)
    ours_batch = build_proofs_many(batch)
    ours_alone = [build_proofs(c)[0] for c in chunks]  # each chunk proven alone
    row: dict[str, float] = {"hidden": hidden_size, "massive_channels": massive, "chunks": 2 * len(ours) + batch_chunks,
           "batch_rows": batch_rows, "batch_tokens": batch_tokens}
    fns = {
        "build_chunk": lambda: [build_proofs(c) for c in chunks],
        "build_batch": lambda: build_proofs_many(batch),
        "build_1024": lambda: build_proofs(h),
        "verify_1024": lambda: measure(h, ours, exact_ties=True),
        "verify_open_1024": lambda: measure(h, ours, exact_ties=False),
    }
    per = {"build_chunk": len(chunks), "build_batch": batch_chunks}  # reported per chunk
    counts = {name: repeats if name == "build_chunk" else max(3, repeats // 3) for name in fns}
    assert measure(h, ours, exact_ties=False) == measure(h, ours, exact_ties=True)  # honest: both zero
    if toploc is None:
        for name, fn in fns.items():
            if name in only:
                row[name] = paired_ms([fn], counts[name])[0] / per.get(name, 1)
        return row
    rows_all = [h[i : i + 1] for i in range(1024)]
    rows_chunks = [rows_all[i : i + 32] for i in range(0, 1024, 32)]
    rows_batch = [[b[i : i + 1] for i in range(batch_tokens)] for b in batch]
    theirs = toploc.build_proofs_bytes(rows_all, 32, 128, skip_prefill=True)
    theirs_batch = [toploc.build_proofs_bytes(r, 32, 128, skip_prefill=True) for r in rows_batch]
    row["byte_equal_chunks"] = sum(a == b for a, b in zip(ours + ours_alone, theirs + theirs)) + sum(
        a == b for mine, its in zip(ours_batch, theirs_batch) for a, b in zip(mine, its))
    their_fns = {
        "build_chunk": lambda: [toploc.build_proofs_bytes(r, 32, 128, skip_prefill=True) for r in rows_chunks],
        "build_batch": lambda: [toploc.build_proofs_bytes(r, 32, 128, skip_prefill=True) for r in rows_batch],
        "build_1024": lambda: toploc.build_proofs_bytes(rows_all, 32, 128, skip_prefill=True),
        "verify_1024": lambda: toploc.verify_proofs_bytes(h, theirs, 32, 128, skip_prefill=True),
    }
    for name in ("build_chunk", "build_batch", "build_1024"):
        if name in only:
            mine, its = paired_ms([fns[name], their_fns[name]], counts[name])
            row[name], row[f"toploc_{name}"] = mine / per.get(name, 1), its / per.get(name, 1)
    if "verify_1024" in only or "verify_open_1024" in only:
        exact, opened, its = paired_ms([fns["verify_1024"], fns["verify_open_1024"], their_fns["verify_1024"]],
                                       counts["verify_1024"])
        row["verify_1024"], row["verify_open_1024"] = exact, opened
        row["toploc_verify_1024"] = row["toploc_verify_open_1024"] = its
    for name in COLUMNS:
        if name in row:
            row[f"speedup_{name}"] = row[f"toploc_{name}"] / row[name]
    return row


def without_c(fn):
    """``fn`` run with verify.topk's C module set aside (as under P2PNET_VERIFY_PURE=1)."""
    def run():
        saved, topk_module.ACCELERATOR = topk_module.ACCELERATOR, None
        try:
            return fn()
        finally:
            topk_module.ACCELERATOR = saved
    return run


def bench_ab(hidden_size: int, massive: int, repeats: int) -> dict:
    """build_chunk and verify_1024 (exact ties) with verify.topk's C module and without it,
    alternately in one loop (the same inputs as ``bench_one``); the proofs must be the same bytes."""
    h = bf16_gaussian(hidden_size, 1024, hidden_size, massive_channels=massive)
    chunks = [h[i : i + 32] for i in range(0, 1024, 32)]
    ours = build_proofs(h)
    build = lambda: [build_proofs(c)[0] for c in chunks]  # noqa: E731
    verify = lambda: measure(h, ours, exact_ties=True)  # noqa: E731
    if build() != without_c(build)() or verify() != without_c(verify)():
        sys.exit(f"hidden {hidden_size}: the proofs or measures differ with and without the C module")
    c_chunk, np_chunk = paired_ms([build, without_c(build)], repeats)
    c_verify, np_verify = paired_ms([verify, without_c(verify)], max(3, repeats // 3))
    return {"hidden": hidden_size, "massive_channels": massive, "build_chunk_c": c_chunk / len(chunks),
            "build_chunk_numpy": np_chunk / len(chunks), "verify_1024_c": c_verify, "verify_1024_numpy": np_verify}


def print_ab(rows: list[dict]) -> None:
    print("\n| hidden | massive ch. | build_chunk C | build_chunk numpy | x | verify_1024 C | verify_1024 numpy | x |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hidden']} | {r['massive_channels']} | {r['build_chunk_c']:.3f} | {r['build_chunk_numpy']:.3f} | "
              f"{r['build_chunk_numpy'] / r['build_chunk_c']:.2f} | {r['verify_1024_c']:.3f} | "
              f"{r['verify_1024_numpy']:.3f} | {r['verify_1024_numpy'] / r['verify_1024_c']:.2f} |")
    print("\nA/B in one loop: verify.topk's C module (verify/_ctopk.c) and without it (the numpy path, as "
          "P2PNET_VERIFY_PURE=1); times in ms (medians), build_chunk per chunk; x = numpy / C.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toploc-path", default=None, help="folder holding a built toploc package")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs per figure (a third for 1024 tokens)")
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="hidden sizes")
    ap.add_argument("--batch-rows", type=int, default=32, help="rollouts in the worker's generation batch")
    ap.add_argument("--batch-tokens", type=int, default=64, help="tokens per rollout of that batch")
    ap.add_argument("--one-core", action="store_true",
                    help="pin the process to one CPU (toploc's verify threads included)")
    ap.add_argument("--only", nargs="+", choices=COLUMNS, default=list(COLUMNS),
                    help="time only these columns (verify_1024 and verify_open_1024 run together)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--ab", action="store_true",
                    help="also time build_chunk and verify_1024 with and without verify.topk's C module")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    toploc: types.ModuleType | None = None
    if args.toploc_path:  # the optional baseline, never a dependency
        sys.path.insert(0, args.toploc_path)
        toploc = importlib.import_module("toploc")
    results = []
    for massive in (0, 8):
        for size in args.sizes:
            results.append(bench_one(toploc, size, massive, args.repeats, args.batch_rows, args.batch_tokens,
                                     tuple(args.only)))
            if not args.json:
                print(f"# hidden {size}, massive channels {massive}: done", file=sys.stderr, flush=True)
    meta = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "toploc": getattr(toploc, "__version__", None), "repeats": args.repeats,
            "one_core": args.one_core, "batch_rows": args.batch_rows, "batch_tokens": args.batch_tokens,
            "topk": "numpy" if topk_module.ACCELERATOR is None else "c"}
    ab = []
    if args.ab and topk_module.ACCELERATOR is not None:
        ab = [bench_ab(size, massive, args.repeats) for massive in (0, 8) for size in args.sizes]
    if args.json:
        print(json.dumps({"meta": meta, "results": results, "ab": ab}, indent=1))
        _exit_if_proofs_differ(results)
        return
    print(f"torch {meta['torch']}, {meta['cpu']}, 1 torch thread, toploc {meta['toploc'] or 'not given'}, "
          f"{'pinned to one core' if args.one_core else 'all cores allowed'}, worker batch "
          f"{args.batch_rows} rows x {args.batch_tokens} tokens, top-k by {meta['topk']}\n")
    cols = [c for c in COLUMNS if c in results[0]]
    their_cols = [c for c in cols if c != "verify_open_1024"]  # one toploc verify serves both ratios
    head = "| hidden | massive ch. | " + " | ".join(f"ours {c}" for c in cols)
    sep = "|---|---|" + "---|" * len(cols)
    if toploc is not None:
        head += " | " + " | ".join(f"toploc {c}" for c in their_cols) + " | " + \
            " | ".join(f"x {c}" for c in cols) + " | byte-equal chunks"
        sep += "---|" * (len(their_cols) + len(cols) + 1)
    print(head + " |\n" + sep)
    for r in results:
        cells = [str(r["hidden"]), str(r["massive_channels"])] + [f"{r[c]:.3f}" for c in cols]
        if toploc is not None:
            cells += [f"{r['toploc_' + c]:.3f}" for c in their_cols] + [f"{r['speedup_' + c]:.2f}" for c in cols]
            cells.append(f"{r['byte_equal_chunks']}/{r['chunks']}")
        print("| " + " | ".join(cells) + " |")
    print("\nTimes in ms (medians); build_batch is per chunk; x = toploc time / ours (above 1: ours is faster); "
          "verify_1024: exact ties (as toploc), verify_open_1024: open ties (the shipped calibration "
          "tables' rule, measured with scripts/calibrate.py --ties open).")
    if ab:
        print_ab(ab)
    _exit_if_proofs_differ(results)



def _exit_if_proofs_differ(results: list[dict]) -> None:
    """Exit non-zero when any proof differed from toploc's (a table of timings is no use then)."""
    if differ := [(r["hidden"], r["massive_channels"]) for r in results
                  if "byte_equal_chunks" in r and r["byte_equal_chunks"] != r["chunks"]]:
        sys.exit(f"proofs differ from toploc's at (hidden size, massive channels) {differ}")


if __name__ == "__main__":
    main()

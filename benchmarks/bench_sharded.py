"""Benchmark of the sharded learner: step time and peak memory per rank, 1 and 2 FSDP2 ranks on CPU.

Owns the numbers in BENCHMARKS.md's "Sharded learner" section. On the same teaching batches
(`trainer.teaching`) it runs, one after the other:

* the one-process learner (`trainer.learner.Learner`, what a user runs without `ranks`), in a
  child process of its own so its peak memory is its own;
* `trainer.ranks.LearnerGroup` with 1 rank and with 2 ranks (torchrun, gloo, one torch thread
  per rank), each publishing every version and taking a DCP checkpoint every step.

It reports per setting the median over the measured steps (the first is a warm-up) of the step
as the trainer waits for it (`step_s`), the training part (`train_s`), what publishing and
checkpointing cost the step (`publish_s`: gathering the full weights on rank 0 and queueing
the version, and starting the DCP save), the DCP save's blocking part and its whole duration,
and each rank's peak resident memory; ratios against the one-process learner.

On a 2-core machine shared with other work this measures that the ranks work and what they
cost, not a speed-up: two ranks share two cores with the trainer and the gloo transport.

Must not: open sockets (torchrun's local rendezvous aside) or download anything.

Run: .venv/bin/python benchmarks/bench_sharded.py [--model tiny] [--steps 6] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer.learner import Learner, LearnerConfig  # noqa: E402
from trainer.model import build_model, save_model_dir  # noqa: E402
from trainer.ranks import GroupConfig, LearnerGroup  # noqa: E402
from trainer.teaching import teaching_batches  # noqa: E402

CONFIG = LearnerConfig(prompts_per_batch=16, group_size=8, keep_last=0, use_worker_logprobs=False)


def _batches(model_name: str, steps: int):
    model, tok = build_model(model_name, seed=0)
    return model, tok, teaching_batches(model, tok, CONFIG, steps)


def one_process(model_name: str, steps: int, work: Path) -> dict:
    """The one-process learner, in this process (run as a child by `main`)."""
    model, tok, batches = _batches(model_name, steps)
    base = save_model_dir(model, tok, work / "base")
    learner = Learner(CONFIG, base, work / "one")
    rows = []
    for batch in batches:
        t0 = time.perf_counter()
        stats = learner.step([batch])
        rows.append({"step_s": time.perf_counter() - t0, "train_s": stats.train_s, "publish_s": stats.snapshot_s})
    learner.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"setting": "one process (Learner)", "ranks": 1, "steps": rows, "max_rss_bytes": [rss]}


def group(model_name: str, steps: int, work: Path, ranks: int) -> dict:
    model, tok, batches = _batches(model_name, steps)
    base = save_model_dir(model, tok, work / f"base{ranks}")
    learner = LearnerGroup(CONFIG, base, work / f"ranks{ranks}", GroupConfig(ranks=ranks, device="cpu"))
    rows = []
    try:
        for batch in batches:
            t0 = time.perf_counter()
            stats = learner.step([batch])
            step_s = time.perf_counter() - t0
            rows.append({"step_s": step_s, "train_s": stats.train_s, "publish_s": stats.snapshot_s})
            if learner.last_checkpoint is not None:  # the save of an earlier version, finished meanwhile
                rows[-1]["dcp_blocking_s"] = learner.last_checkpoint.blocking_s
                rows[-1]["dcp_total_s"] = learner.last_checkpoint.total_s
        memory = learner.memory()
    finally:
        learner.close()
    return {"setting": f"LearnerGroup, {ranks} rank{'s' if ranks > 1 else ''} (FSDP2, gloo)", "ranks": ranks,
            "steps": rows, "max_rss_bytes": [m["max_rss_bytes"] for m in memory]}


def summarise(run: dict, reference: dict | None) -> dict:
    measured = run["steps"][1:]  # the first step is a warm-up
    med = {k: statistics.median(r[k] for r in measured if k in r)
           for k in ("step_s", "train_s", "publish_s", "dcp_blocking_s", "dcp_total_s")
           if any(k in r for r in measured)}
    out = {"setting": run["setting"], "ranks": run["ranks"], "steps_measured": len(measured),
           **{k: round(v, 4) for k, v in med.items()},
           "max_rss_mb_per_rank": [round(b / 2**20) for b in run["max_rss_bytes"]]}
    if reference is not None:
        ref = statistics.median(r["step_s"] for r in reference["steps"][1:])
        out["step_s_vs_one_process"] = round(med["step_s"] / ref, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a tiny model name (tiny, micro, small)")
    parser.add_argument("--steps", type=int, default=6, help="steps per setting, the first a warm-up (default 6)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument("--one-process-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one_process_child is not None:
        print(json.dumps(one_process(args.model, args.steps, args.one_process_child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        child = subprocess.run([sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                                "--one-process-child", str(work)], capture_output=True, text=True, check=True)
        reference = json.loads(child.stdout.strip().splitlines()[-1])
        runs = [reference] + [group(args.model, args.steps, work, n) for n in (1, 2)]
    table = [summarise(r, None if r is reference else reference) for r in runs]
    print(f"model {args.model}, {CONFIG.prompts_per_batch}x{CONFIG.group_size} rows per step, "
          f"{args.steps} steps per setting (first is warm-up); medians in seconds")
    for row in table:
        print(json.dumps(row))
    if args.json is not None:
        args.json.write_text(json.dumps({"model": args.model, "rows": table}, indent=2))


if __name__ == "__main__":
    main()

"""Check every row of honest batches, as the devnet's validator does, from every version of a run.

    PYTHONPATH=. .venv/bin/python scripts/honest_checks.py DIR [--steps 20] [--tasks arithmetic] [--task-seed 0] [--json FILE]

DIR holds a run's model folders `v0`, `v1`, ... (a trainer's checkpoint folder: `p2pnet devnet
--keep-last 1000 --out OUT` keeps them all in `OUT/trainer/ckpt`). For each version, honest workers
generate batches as `trainer.rollout` does (the devnet's generation settings: 16 prompts of the
run's `--tasks` and `--task-seed`, groups of 8, 3 new tokens, temperature 1), for `--steps` steps
from the version's own, and every batch is checked whole, all its rows, by the checker a devnet
validator builds from its configuration (`verify.daemon.SubmissionChecker.from_config`: the
sampling seed, the assigned prompts, the stop reason, TOPLOC with the thresholds and tie rule the
calibration tables give, the seeded replay, the termination rule, the submission-level test).
Prints, per version, the rows checked, how many ended with an EOS and the least probable EOS
sampled, and every rejection with the validator's numbers (`verify.daemon.Judgement`,
`verify.check.explain`): a false rejection of an honest worker, and how near the run came to one. Exit status 1 if any
honest row or batch was rejected.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

WORKERS = ("worker1", "worker2")
PROMPTS = 16  # prompts per batch, as the devnet's


def versions(folder: Path) -> list[int]:
    found = sorted(int(m.group(1)) for p in folder.iterdir() if (m := re.fullmatch(r"v(\d+)", p.name)) and p.is_dir())
    if not found:
        raise SystemExit(f"{folder}: no version folders v0, v1, ... (a trainer's checkpoint folder holds them)")
    return found


def check_version(folder: Path, version: int, steps: int, tasks: str = "arithmetic", task_seed: int = 0) -> dict[str, Any]:
    """`steps` honest batches per worker from version `version` (`folder`/v<version>), each checked
    whole by the checker a devnet validator builds (`SubmissionChecker.from_config`)."""
    import torch

    from models.folder import load_model_dir
    from tasks.prompts import TaskConfig, assign_prompts
    from trainer.rollout import GenerationConfig, generate_batch
    from verify.daemon import ModelSource, SubmissionChecker, ValidatorConfig
    from verify.messages import stack_of, submission_from_batch
    from verify.validator import CheckRequested

    torch.set_num_threads(1)
    model, tokenizer = load_model_dir(folder / f"v{version}")
    config = GenerationConfig(group_size=8, max_new_tokens=3, temperature=1.0)
    validator = ValidatorConfig(checkpoint_dir=folder, task_seed=task_seed, tasks=tasks)
    checker = SubmissionChecker.from_config(validator, ModelSource(None, folder, cache_size=1))
    rows = eos = 0
    least = math.inf
    rejected: list[str] = []
    for step in range(version, version + steps):
        for worker in WORKERS:
            batch, _ = generate_batch(model, tokenizer,
                                      assign_prompts(worker, step, task_seed, PROMPTS, TaskConfig.from_spec(tasks)),
                                      worker_id=worker, step=step, model_version=version, seed=task_seed,
                                      config=config)
            sub = submission_from_batch(batch, model="honest", prompts_per_submission=PROMPTS, nonce=bytes(16),
                                        stack=stack_of(model, "torch"))
            judgement = checker.judge(CheckRequested(b"h" * 32, worker, sub, b"t" * 64, tuple(range(len(sub.rollouts)))))
            rows += len(sub.rollouts)
            for r in batch.rollouts:
                if r.stop_reason == "eos":
                    eos += 1
                    least = min(least, math.exp(r.logprobs[-1]))
            for row, ok, codes in judgement.rows:
                if not ok:
                    rejected.append(f"{worker} step {step} row {row}: " + judgement.explained.get(row, ",".join(codes)))
            if not judgement.accepted and all(ok for _, ok, _ in judgement.rows):  # refused whole (seed, submission-level test)
                test = f" the submission-level test: {judgement.evidence}" if judgement.evidence else ""
                rejected.append(f"{worker} step {step} batch: {','.join(judgement.reasons)}{test}")
    return {"version": version, "rows": rows, "eos": eos, "least_eos_prob": least if eos else None,
            "rejected": rejected}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the run's version folders (v0, v1, ...)")
    parser.add_argument("--steps", type=int, default=20, help="steps generated per version and worker (default 20)")
    parser.add_argument("--json", type=Path, help="also write the per-version results here")
    parser.add_argument("--tasks", default="arithmetic", help="the run's task families (its --tasks; default arithmetic)")
    parser.add_argument("--task-seed", type=int, default=0, help="the run's task seed (its --seed; default 0)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    results = []
    print(f"{'version':>7} {'rows':>7} {'eos':>7} {'least EOS p':>11} {'rejected':>8}")
    for version in versions(args.folder):
        out = check_version(args.folder, version, args.steps, args.tasks, args.task_seed)
        results.append(out)
        least = f"{out['least_eos_prob']:.3g}" if out["least_eos_prob"] is not None else "-"
        print(f"{version:>7} {out['rows']:>7} {out['eos']:>7} {least:>11} {len(out['rejected']):>8}", flush=True)
        for line in out["rejected"]:
            print(f"        rejected {line}", flush=True)
    total = sum(len(r["rejected"]) for r in results)
    print(f"{sum(r['rows'] for r in results)} honest rows checked, {total} rejected")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())

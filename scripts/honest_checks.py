"""Check every row of honest batches, as the devnet's validator does, from every version of a run.

    PYTHONPATH=. .venv/bin/python scripts/honest_checks.py DIR [--steps 20] [--json FILE]

DIR holds a run's model folders `v0`, `v1`, ... (a trainer's checkpoint folder: `p2pnet devnet
--keep-last 1000 --out OUT` keeps them all in `OUT/trainer/ckpt`). For each version, honest workers
generate batches as `trainer.rollout` does (the devnet's generation settings: 16 prompts, groups
of 8, 3 new tokens, temperature 1), for `--steps` steps from the version's own, and every row is
checked with `verify.check.check_rollout` (the paper's thresholds, the seeded replay, the
termination rule). Prints, per version, the rows checked, how many ended with an EOS and the
least probable EOS sampled, and every rejection with its numbers (`verify.check.explain`): a
false rejection of an honest worker, and how near the run came to one. Exit status 1 if any
honest row was rejected.
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


def versions(folder: Path) -> list[tuple[int, Path]]:
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := re.fullmatch(r"v(\d+)", p.name)) and p.is_dir())
    if not found:
        raise SystemExit(f"{folder}: no version folders v0, v1, ... (a trainer's checkpoint folder holds them)")
    return found


def check_version(path: Path, version: int, steps: int) -> dict[str, Any]:
    import torch

    from models.folder import load_model_dir
    from models.forward import hidden_and_logits
    from tasks.prompts import assign_prompts
    from trainer.rollout import GenerationConfig, generate_batch
    from verify.check import check_rollout, explain

    torch.set_num_threads(1)
    model, tokenizer = load_model_dir(path)
    config = GenerationConfig(group_size=8, max_new_tokens=3, temperature=1.0)
    rows = eos = 0
    least = math.inf
    rejected: list[str] = []
    for step in range(version, version + steps):
        for worker in WORKERS:
            batch, _ = generate_batch(model, tokenizer, assign_prompts(worker, step, 0, 16), worker_id=worker,
                                      step=step, model_version=version, seed=0, config=config)
            for r in batch.rollouts:
                verdict = check_rollout(lambda ids: hidden_and_logits(model, ids), r.prompt_ids, r.output_ids,
                                        r.proofs, seed=batch.sampling_seed, row=r.row, temperature=config.temperature,
                                        eos_token_id=tokenizer.eos_id, max_new_tokens=config.max_new_tokens,
                                        vocab_size=tokenizer.vocab_size)
                rows += 1
                if r.stop_reason == "eos":
                    eos += 1
                    least = min(least, math.exp(r.logprobs[-1]))
                if not verdict.accepted:
                    rejected.append(f"{worker} step {step} row {r.row}: {explain(verdict)}")
    return {"version": version, "rows": rows, "eos": eos, "least_eos_prob": least if eos else None,
            "rejected": rejected}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the run's version folders (v0, v1, ...)")
    parser.add_argument("--steps", type=int, default=20, help="steps generated per version and worker (default 20)")
    parser.add_argument("--json", type=Path, help="also write the per-version results here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    results = []
    print(f"{'version':>7} {'rows':>7} {'eos':>7} {'least EOS p':>11} {'rejected':>8}")
    for version, path in versions(args.folder):
        out = check_version(path, version, args.steps)
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

"""Which outer step DiLoCo needs on the tiny model: a sweep of outer lr and momentum, and a
per-round trace of why DiLoCo's defaults (lr 0.7, momentum 0.9) stall and spike there.

Owns the outer-settings table and the trace figures of the DiLoCo section of BENCHMARKS.md and
docs/experiments.md. The setup is `bench_diloco.py`'s in-process one (4 peers, int8 all-reduce
cores delivered in memory, the same data shards and held-out set), so its curves are those of
`bench_diloco.py --outer-lr X --outer-momentum Y` for the same settings.

  sweep: for each "lr,momentum", the held-out loss per round; printed: final, lowest, mean of
         the last 10 rounds, highest after round 10.
  trace: for each of 0.7,0.9 and 0.7,0.0, per round: loss, norm of the mean pseudo-gradient,
         its cosine to the previous round's, the mean cosine of each peer's to the mean, and the
         norm of the outer update (and its ratio to the mean's).

Must not: download anything. Heavy (about 40 s per setting): run it under
`flock /tmp/p2pnet-cpu.lock`.

Run: PYTHONPATH=. .venv/bin/python benchmarks/bench_diloco_outer.py --rounds 30 \\
         --sweep 0.7,0.9 0.5,0.9 0.3,0.9 0.4,0.8 0.7,0.5 0.7,0.3 1.0,0 0.9,0 0.7,0 0.5,0 --trace
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from bench_diloco import run_diloco  # noqa: E402
from trainer.diloco import Encoding, OuterConfig  # noqa: E402


def _setup(rounds: int) -> argparse.Namespace:
    return argparse.Namespace(peers=4, rounds=rounds, inner_steps=20, inner_lr=3e-3, batch_size=32, model="tiny",
                              outer_lr=0.7, outer_momentum=0.9)


def sweep(settings: list[tuple[float, float]], rounds: int) -> dict[str, list[float]]:
    curves = {}
    for lr, momentum in settings:
        result = run_diloco(_setup(rounds), Encoding.INT8, OuterConfig(lr, momentum))
        curve = [loss for _, loss in result["curve"]]
        curves[f"{lr},{momentum}"] = curve
        print(f"outer lr {lr} momentum {momentum}: final {curve[-1]:.3f}, lowest {min(curve):.3f}, "
              f"mean of the last 10 {sum(curve[-10:]) / len(curve[-10:]):.3f}, "
              f"highest after round 10 {max(curve[10:] or [float('nan')]):.3f}", flush=True)
        print("  " + " ".join(f"{loss:.2f}" for loss in curve), flush=True)
    return curves


def trace(lr: float, momentum: float, rounds: int) -> list[dict[str, float]]:
    print(f"outer lr {lr} momentum {momentum}", flush=True)
    rows = run_diloco(_setup(rounds), Encoding.INT8, OuterConfig(lr, momentum))["rounds"]
    for row in rows:
        print(f"  round {row['round']:2d} loss {row['loss']:.3f} |mean| {row['mean_norm']:.3f} cos(previous) "
              f"{row['cos_previous']:+.2f} peer-vs-mean cos {row['peer_cos']:.2f} |update| {row['update_norm']:.3f} "
              f"ratio {row['ratio']:.2f}", flush=True)
    return rows


def _setting(text: str) -> tuple[float, float]:
    """`LR,MOMENTUM` as two floats (ValueError when there are not two)."""
    lr, momentum = (float(x) for x in text.split(","))
    return lr, momentum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sweep", nargs="*", default=[], metavar="LR,MOMENTUM")
    parser.add_argument("--trace", action="store_true", help="also trace 0.7,0.9 and 0.7,0.0 round by round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = [_setting(s) for s in args.sweep]
    results: dict[str, object] = {"sweep": sweep(settings, args.rounds)}
    if args.trace:
        results["trace"] = {f"{lr},{m}": trace(lr, m, args.rounds) for lr, m in ((0.7, 0.9), (0.7, 0.0))}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

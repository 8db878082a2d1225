"""Benchmark of the devnet: where one training step's time goes, with real peer processes.

Owns the numbers in benchmarks/results/devnet.md. It runs `trainer.devnet.run_devnet` (trainer,
relays, workers, validators as separate `p2pnet peer start` processes on loopback), reads every
peer's status through its control socket while the devnet runs (the `observe` hook of
run_devnet), and reports per training step:

- generation and proof building (the slowest worker's `generate_s` / `proof_s`; proof building
  as a share of generation), the worker's model load for the new version, tokens per second;
- verification (validator `check_s` of that step's verdicts: waiting for the version, loading
  it, one prefill per checked row);
- training (`train_s`: admission, rewards, one AdamW step), the checkpoint write and the relay
  publish of the new version (`write_s`, `publish_s`);
- propagation: the trainer's `propagation_s` (publish until every worker announced holding the
  version; resolution about the announce interval, 1 s in the devnet) and, per peer, the relay
  transfer time of the checkpoint (manifest known until the last chunk verified, read from the
  relay's progress as fetched_bytes / bytes_per_s);
- the step time at the trainer (between consecutive steps' ends) and what is left of it
  (gossip, polling, queueing on a shared CPU).

Must not: change the devnet's behaviour; it only reads statuses.

Run: .venv/bin/python benchmarks/bench_devnet.py [--model tiny|DIR] [--steps 5] [--workers 2]
     [--validators 1] [--relays 1] [--prompts-per-batch 16] [--group-size 8] [--max-new-tokens 3]
     [--json PATH] [--write LABEL]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pnet.errors import PeerUnavailable  # noqa: E402
from trainer.devnet import DevnetConfig, run_devnet  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "devnet.md"


class Observer:
    """Collects what the peers' statuses expose, merged over polls (statuses keep only recent items)."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.every_s = every_s
        self.last_poll = 0.0
        self.trainer: dict[str, Any] = {}
        self.submitted: dict[str, dict[int, dict[str, Any]]] = {}   # worker -> step -> entry
        self.verdicts: dict[str, dict[str, Any]] = {}              # submission id -> verdict event
        self.validator_stats: dict[str, dict[str, Any]] = {}
        self.relay: dict[str, dict[int, dict[str, Any]]] = {}      # peer -> version -> progress

    def __call__(self, procs: dict[str, Any]) -> None:
        trainer = procs["trainer"].status(timeout_s=30)["role_status"]["trainer"]
        self.trainer = trainer
        if time.monotonic() - self.last_poll < self.every_s and not trainer["done"]:
            return
        self.last_poll = time.monotonic()
        for name, proc in procs.items():
            try:
                roles = proc.status(timeout_s=30)["role_status"]
            except PeerUnavailable:
                continue  # a busy peer misses one poll; the next one catches up
            self._take(name, roles)

    def _take(self, name: str, roles: dict[str, Any]) -> None:
        for entry in roles.get("worker", {}).get("submitted", []):
            self.submitted.setdefault(name, {})[entry["step"]] = entry
        validator = roles.get("validator")
        if validator:
            self.validator_stats[name] = {k: v for k, v in validator.items() if k != "recent"}
            for event in validator.get("recent", []):
                if event["event"] == "verdict":
                    self.verdicts[event["submission_id"]] = dict(event, validator=name)
        for row in roles.get("relay", {}).get("transfers", {}).get("progress", []):
            mine = self.relay.setdefault(name, {})
            if row["complete"] or row["version"] not in mine:
                mine[row["version"]] = row


def _transfer_s(row: dict[str, Any]) -> float | None:
    """Seconds from knowing the manifest to the last verified chunk (progress keeps only the rate)."""
    if not row["complete"] or row["origin"] or not row["fetched_bytes"] or not row["bytes_per_s"]:
        return None
    return row["fetched_bytes"] / row["bytes_per_s"]


def analyse(obs: Observer, summary: dict[str, Any], wall_s: float) -> dict[str, Any]:
    history = [h for h in obs.trainer["history"] if h["trained"]]
    by_version = {h["version"]: h for h in history}
    steps = []
    prev_t = None
    for h in history:
        n = h["step"]
        subs = [s[n] for s in obs.submitted.values() if n in s]
        slow = max(subs, key=lambda s: s["generate_s"] + s["proof_s"]) if subs else {}
        checks = [v["check_s"] for v in obs.verdicts.values() if v["step"] == n]
        published = by_version.get(n, {})  # the entry that produced version n timed its write/publish
        transfers = [t for peer in obs.relay.values() if (row := peer.get(n)) and (t := _transfer_s(row))]
        row = {
            "step": n, "step_s": None if prev_t is None else round(h["t_s"] - prev_t, 3),
            "generate_s": slow.get("generate_s"), "proof_s": slow.get("proof_s"), "load_s": slow.get("load_s"),
            "tokens": sum(s["tokens"] for s in subs), "worker_tokens": slow.get("tokens"),
            "verify_s": max(checks) if checks else None, "verdicts": len(checks),
            "train_s": h["train_s"], "gather_s": h["gather_s"],
            "write_s": published.get("write_s"), "publish_s": published.get("publish_s"),
            "propagation_s": h.get("propagation_s"),
            "transfer_max_s": round(max(transfers), 3) if transfers else None, "transfer_peers": len(transfers),
            "accepted_batches": h["accepted_batches"], "rejected_batches": h["rejected_batches"],
        }
        parts = ("write_s", "publish_s", "transfer_max_s", "load_s", "generate_s", "proof_s", "verify_s", "train_s")
        row["other_s"] = (round(row["step_s"] - sum(row[k] or 0 for k in parts), 3)
                          if row["step_s"] is not None else None)
        steps.append(row)
        prev_t = h["t_s"]
    timed = [s for s in steps if s["step_s"] is not None] or steps

    def med(key: str) -> float | None:
        vals = [s[key] for s in timed if s[key] is not None]
        return round(statistics.median(vals), 4) if vals else None

    gen = sum(s["generate_s"] or 0 for s in steps)
    proof = sum(s["proof_s"] or 0 for s in steps)
    worker_tokens = sum(s["worker_tokens"] or 0 for s in steps)
    return {
        "steps": steps,
        "median": {k: med(k) for k in ("step_s", "generate_s", "proof_s", "load_s", "verify_s", "train_s",
                                       "write_s", "publish_s", "propagation_s", "transfer_max_s", "gather_s",
                                       "other_s")},
        "proof_share": round(proof / gen, 5) if gen else None,
        "worker_tokens_per_s": round(worker_tokens / gen, 1) if gen else None,
        "network_tokens_per_s": (round(sum(s["tokens"] for s in timed) / sum(s["step_s"] for s in timed), 2)
                                 if all(s["step_s"] for s in timed) and timed else None),
        "checkpoint_bytes": max((r["fetched_bytes"] for p in obs.relay.values() for r in p.values()
                                 if _transfer_s(r)), default=None),
        "validators": obs.validator_stats,
        "transfers_s": {peer: {v: round(t, 3) for v, row in sorted(rows.items()) if (t := _transfer_s(row))}
                        for peer, rows in obs.relay.items()},
        "chunks_fetched": {peer: {v: row["fetched_chunks"] for v, row in sorted(rows.items()) if not row["origin"]}
                           for peer, rows in obs.relay.items()},
        "devnet_ok": summary["ok"], "wall_s": round(wall_s, 1),
    }


def table(result: dict[str, Any]) -> str:
    cols = [("step", "step"), ("step_s", "step (s)"), ("generate_s", "generate (s)"), ("proof_s", "proofs (s)"),
            ("load_s", "worker load (s)"), ("verify_s", "verify (s)"), ("train_s", "train (s)"),
            ("write_s", "ckpt write (s)"), ("publish_s", "publish (s)"), ("propagation_s", "propagation (s)"),
            ("transfer_max_s", "transfer, slowest peer (s)"), ("other_s", "other (s)"), ("tokens", "tokens")]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + " --- |" * len(cols)]
    for s in result["steps"]:
        cells = []
        for key, _ in cols:
            v = s[key]
            cells.append("-" if v is None else (str(v + 1) if key == "step" else f"{v:g}"))
        lines.append("| " + " | ".join(cells) + " |")
    m = result["median"]
    lines.append("| median | " + " | ".join("-" if m.get(k) is None else f"{m[k]:g}" for k, _ in cols[1:-1])
                 + " | - |")
    share = result["proof_share"]
    lines += ["", f"proof building / generation: {'-' if share is None else f'{100 * share:.2f}%'}; "
              f"worker tokens/s (generation only): {result['worker_tokens_per_s']}; "
              f"network tokens/s (all workers' tokens / step time): {result['network_tokens_per_s']}; "
              f"checkpoint bytes moved per peer: {result['checkpoint_bytes']}; "
              f"devnet ok: {result['devnet_ok']}; wall {result['wall_s']} s",
              "", f"relay transfer seconds per peer and version: {result['transfers_s']}; "
              f"chunks fetched per peer and version: {result['chunks_fetched']}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description="devnet step-time benchmark")
    ap.add_argument("--model", default="tiny", help="tiny, micro, small, or a model folder")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--validators", type=int, default=1)
    ap.add_argument("--relays", type=int, default=1)
    ap.add_argument("--prompts-per-batch", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--poll-s", type=float, default=2.0, help="seconds between full status polls")
    ap.add_argument("--out", type=Path, help="keep the devnet's data dirs and logs here")
    ap.add_argument("--json", type=Path, help="write the raw result here")
    ap.add_argument("--write", metavar="LABEL", help="append a section with this title to the results file")
    args = ap.parse_args()
    config = DevnetConfig(steps=args.steps, workers=args.workers, validators=args.validators, relays=args.relays,
                          byzantine=0, model=args.model, timeout_s=args.timeout_s,
                          prompts_per_batch=args.prompts_per_batch, group_size=args.group_size,
                          max_new_tokens=args.max_new_tokens)
    obs = Observer(args.poll_s)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-devnet-") as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        summary = run_devnet(config, root, plot_to=root / "reward.png", observe=obs)
    result = analyse(obs, summary, time.monotonic() - started)
    md = table(result)
    print(md)
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"out": str(args.out), "json": str(args.json)},
                                         "result": result, "trainer": obs.trainer, "submitted": obs.submitted,
                                         "verdicts": obs.verdicts, "relay": obs.relay}, indent=2, default=str))
    if args.write:
        cmd = "python benchmarks/bench_devnet.py " + " ".join(a for a in sys.argv[1:])
        with RESULTS.open("a") as f:
            f.write(f"\n## {args.write}\n\nCommand: `{cmd.strip()}`\n\n{md}\n")


if __name__ == "__main__":
    main()

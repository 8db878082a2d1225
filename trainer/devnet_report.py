"""What `p2pnet devnet` shows: the live line per step, the summary (table, workers, disk) and
the reward plot. Pure formatting of the trainer's status; no processes, no sockets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def progress_line(row: dict[str, Any], role: dict[str, Any], names: dict[str, str], steps: int, peers: int,
                  elapsed_s: float) -> str:
    """One live line: step, reward, how fast the step's checkpoint spread, per-worker verdicts."""
    spread = row.get("propagation_s")  # of the version this step's batches were generated with
    spread_text = f"v{row['step']} reached all workers in {spread:.2f}s" if spread is not None else "-"
    workers = ", ".join(
        f"{names.get(w['peer_id'], w['peer_id'][-6:])} {w['accepted']}ok/{w['rejected']}bad"
        + (" BANNED" if w["banned"] else "") for w in role["workers"])
    return (f"step {row['step'] + 1:>3}/{steps}  reward {row['reward_mean']:.3f}  {spread_text}  "
            f"[{workers}]  peers {peers}  t={elapsed_s:.0f}s")


def summarise(status: dict[str, Any], ids: dict[str, str], byzantine: set[str], codes: dict[str, int],
              validators: dict[str, Any], wall_s: float) -> dict[str, Any]:
    by_id = {w["peer_id"]: w for w in status["workers"]}
    workers = []
    for name, peer_id in ids.items():
        if not name.startswith("worker"):
            continue
        w = by_id.get(peer_id, {})
        workers.append({"name": name, "peer_id": peer_id, "byzantine": name in byzantine,
                        "submitted": w.get("submitted", 0), "accepted": w.get("accepted", 0),
                        "rejected": w.get("rejected", 0), "banned": w.get("banned", False),
                        "trained_batches": w.get("trained_batches", 0)})
    steps = [{"step": h["step"], "reward_mean": h["reward_mean"], "accuracy": h["accuracy"],
              "propagation_s": h.get("propagation_s"), "accepted_batches": h["accepted_batches"],
              "rejected_batches": h["rejected_batches"], "trained_batches": h["batches"], "train_s": h["train_s"]}
             for h in status["history"] if h["trained"]]
    caught = all(w["banned"] and w["trained_batches"] == 0 for w in workers if w["byzantine"])
    return {"ok": bool(steps) and caught and all(c == 0 for c in codes.values()), "wall_s": round(wall_s, 1),
            "steps": steps, "workers": workers, "validators": validators, "exit_codes": codes,
            "byzantine_caught": caught}


def print_summary(summary: dict[str, Any], byzantine: int) -> None:
    steps = summary["steps"]
    print("\nstep  reward  accuracy  propagation_s  accepted  rejected")
    for s in steps:
        prop = "-" if s["propagation_s"] is None else f"{s['propagation_s']:.2f}"
        print(f"{s['step'] + 1:>4}  {s['reward_mean']:.3f}   {s['accuracy']:.3f}     {prop:>9}      "
              f"{s['accepted_batches']:>4}      {s['rejected_batches']:>4}")
    print("\nworker    byzantine  submitted  accepted  rejected  banned  trained")
    for w in summary["workers"]:
        print(f"{w['name']:<9} {str(w['byzantine']):<9}  {w['submitted']:>9}  {w['accepted']:>8}  "
              f"{w['rejected']:>8}  {str(w['banned']):<6}  {w['trained_batches']:>7}")
    reasons = {row.get("devnet_name"): row.get("rejection_reasons", {}) for row in summary.get("leaderboard", [])}
    for name in honest_rejections(summary):
        why = ", ".join(f"{code} x{n}" for code, n in sorted(reasons.get(name, {}).items())) or "not reported"
        print(f"honest {name} had batches rejected (first reason of each rejecting verdict: {why})")
    if len(steps) >= 2:
        k = max(1, len(steps) // 4)
        first = sum(s["reward_mean"] for s in steps[:k]) / k
        last = sum(s["reward_mean"] for s in steps[-k:]) / k
        print(f"\nreward mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    if byzantine:
        print(f"byzantine workers caught and kept out of training: {summary['byzantine_caught']}")
    disk = summary["disk"]
    print(f"wall {summary['wall_s']:.0f}s; disk {_gb(disk['total_bytes'])} (trainer checkpoints "
          f"{_gb(disk['trainer_checkpoints_bytes'])}, relay stores {_gb(disk['relay_stores_bytes'])})")


def honest_rejections(summary: dict[str, Any]) -> list[str]:
    """Workers not told to cheat whose batches a validator rejected: a false rejection, or a fault
    of ours, either way worth its logs."""
    return [w["name"] for w in summary["workers"] if not w["byzantine"] and w["rejected"]]


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def plot_rewards(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = summary["steps"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s["step"] + 1 for s in steps], [s["reward_mean"] for s in steps], marker="o", label="reward mean")
    ax.set_xlabel("training step")
    ax.set_ylabel("reward (exact answers)")
    ax.set_title("p2pnet devnet: GRPO on verified batches")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def disk_usage(root: Path) -> dict[str, int]:
    """Bytes on disk under `root` (blocks, so sparse files count what they use): in all, the
    trainer's checkpoints, and the relays' stores together."""
    def used(folder: Path) -> int:
        total = 0
        for item in folder.rglob("*") if folder.is_dir() else ():
            try:
                st = item.lstat()
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512 if item.is_file() and not item.is_symlink() else 0
        return total

    peers = [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
    return {"total_bytes": used(root), "trainer_checkpoints_bytes": used(root / "trainer" / "ckpt"),
            "relay_stores_bytes": sum(used(d / "relay") for d in peers)}

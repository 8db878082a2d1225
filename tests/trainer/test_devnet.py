"""A short devnet with real processes: reward rises, the cheater is banned and never trained on."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_devnet_learns_on_verified_batches_and_bans_the_cheater(tmp_path):
    out = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, "-m", "p2pnet", "devnet", "--steps", "16", "--workers", "3", "--byzantine", "1",
         "--validators", "1", "--relays", "1", "--out", str(tmp_path / "net"), "--json", str(out),
         "--timeout-s", "420"],
        capture_output=True, text=True, timeout=480)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())
    steps = summary["steps"]
    assert len(steps) == 16
    for key in ("step", "reward_mean", "propagation_s", "accepted_batches", "rejected_batches"):
        assert key in steps[0]
    first = sum(s["reward_mean"] for s in steps[:4]) / 4
    last = sum(s["reward_mean"] for s in steps[-4:]) / 4
    assert last > first, f"reward did not rise: {first:.3f} -> {last:.3f}"
    cheaters = [w for w in summary["workers"] if w["byzantine"]]
    honest = [w for w in summary["workers"] if not w["byzantine"]]
    assert len(cheaters) == 1 and len(honest) == 2
    assert cheaters[0]["banned"] and cheaters[0]["trained_batches"] == 0 and cheaters[0]["rejected"] >= 2
    assert all(w["trained_batches"] > 0 and not w["banned"] and w["rejected"] == 0 for w in honest)
    for w in summary["workers"]:
        assert set(w) >= {"peer_id", "byzantine", "accepted", "rejected", "banned", "trained_batches"}
    assert all(code == 0 for code in summary["exit_codes"].values())
    assert (tmp_path / "net" / "reward.png").stat().st_size > 1000

"""A short devnet with real processes: reward rises, the cheater is banned and never trained on
(the session's shared run, `devnet_run` in conftest.py); and `p2pnet devnet --lab` from the
command line, a worker behind NAT."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_devnet_learns_on_verified_batches_and_bans_the_cheater(devnet_run):
    summary = devnet_run.summary
    assert summary["ok"], devnet_run.printed[-3000:]
    steps = summary["steps"]
    assert len(steps) == devnet_run.steps == 16
    for key in ("step", "reward_mean", "propagation_s", "accepted_batches", "rejected_batches"):
        assert key in steps[0]
    first = sum(s["reward_mean"] for s in steps[:4]) / 4
    last = sum(s["reward_mean"] for s in steps[-4:]) / 4
    assert last > first, f"reward did not rise: {first:.3f} -> {last:.3f}"
    cheaters = [w for w in summary["workers"] if w["byzantine"]]
    honest = [w for w in summary["workers"] if not w["byzantine"]]
    assert len(cheaters) == 1 and len(honest) == 2
    assert cheaters[0]["banned"] and cheaters[0]["trained_batches"] == 0 and cheaters[0]["rejected"] >= 2
    kept = json.loads((devnet_run.root / "net" / "trainer" / "ckpt" / "intake_state.json").read_text())
    assert list(kept["reputation"]["banned_until"]) == [cheaters[0]["peer_id"]]  # what a restarted trainer reads
    assert all(w["trained_batches"] > 0 and not w["banned"] and w["rejected"] == 0 for w in honest)
    for w in summary["workers"]:
        assert set(w) >= {"peer_id", "byzantine", "accepted", "rejected", "banned", "trained_batches"}
    assert all(code == 0 for code in summary["exit_codes"].values())
    assert json.loads(json.dumps(summary)) == summary  # what `--json` writes holds all of it
    assert (devnet_run.root / "reward.png").stat().st_size > 1000


def test_devnet_on_lab_hosts_with_a_worker_behind_nat(tmp_path):
    """`devnet --lab`: every peer on its own host over 100 Mbit/s links; an honest worker behind
    NAT still gets every version, and its verified batches are trained on."""
    from p2pnet.lab import nat_unavailable

    reason = nat_unavailable()
    if reason:
        pytest.skip(reason)
    profile = tmp_path / "links.toml"
    profile.write_text('[[host]]\nname = "worker1"\nupload_mbit = 20\ndownload_mbit = 80\nnat = "home"\n')
    out = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, "-m", "p2pnet", "devnet", "--lab", "--link-mbit", "100", "--lab-profile", str(profile),
         "--steps", "6", "--workers", "2", "--byzantine", "1", "--validators", "1", "--relays", "0",
         "--out", str(tmp_path / "net"), "--json", str(out), "--timeout-s", "400"],
        capture_output=True, text=True, timeout=480)
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]  # 1: cheater not yet banned
    assert "on lab hosts" in run.stdout
    summary = json.loads(out.read_text())
    assert summary["lab"]["worker1"]["nat"] == "home" and summary["lab"]["trainer"]["upload_mbit"] == 100
    assert len(summary["steps"]) == 6
    workers = {w["name"]: w for w in summary["workers"]}
    assert workers["worker1"]["trained_batches"] > 0 and workers["worker1"]["rejected"] == 0
    assert workers["worker0"]["trained_batches"] == 0
    assert all(code == 0 for code in summary["exit_codes"].values())


def test_link_limits_without_the_lab_are_refused():
    from p2pnet.errors import ConfigError
    from trainer.devnet import DevnetConfig

    with pytest.raises(ConfigError, match="need --lab"):
        DevnetConfig(link_mbit=100.0)
    with pytest.raises(ConfigError, match="link-mbit"):
        DevnetConfig(lab=True, link_mbit=0.0)
    assert DevnetConfig(lab=True, link_mbit=50.0).link_mbit == 50.0

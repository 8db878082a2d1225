"""A short devnet with real processes: reward rises, the cheater is banned and never trained on;
after it, every peer's /metrics parses (promtool too) and carries its role's series, the trainer's
metrics.jsonl has one line per step, `p2pnet leaderboard --json` and the dashboard API agree, and
headless Chromium renders the page with the curves and the leaderboard's real rows, which match
the JSON API (the session's shared run, `devnet_run` in conftest.py: its readers stay in this file,
which one of `make test`'s xdist workers runs whole, so the devnet runs once); and
`p2pnet devnet --lab` from the command line, a worker behind NAT."""

import html
import json
import re
import shutil
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
ROLE_SERIES = {
    "trainer": {"p2pnet_trainer_step", "p2pnet_trainer_loss", "p2pnet_trainer_reward_mean", "p2pnet_trainer_batches",
                "p2pnet_trainer_last_step_phase_seconds", "p2pnet_trainer_step_phase_seconds",
                "p2pnet_trainer_checkpoint_publish_seconds", "p2pnet_relay_bytes_served"},
    "validator0": {"p2pnet_validator_verdicts", "p2pnet_validator_check_seconds", "p2pnet_relay_version_complete_seconds"},
    "worker1": {"p2pnet_worker_rollouts", "p2pnet_worker_tokens_generated", "p2pnet_worker_tokens_per_second",
                "p2pnet_worker_proof_build_seconds", "p2pnet_relay_bytes_received", "p2pnet_relay_chunks_verified"},
}


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


def leaderboard_rows_in(dom):
    """(peer id, cells) of each leaderboard row the page rendered."""
    table = dom.split('id="leaderboard"', 1)[1].split("</table>", 1)[0]
    rows = []
    for peer, body in re.findall(r'<tr data-peer="([^"]*)">(.*?)</tr>', table, re.S):
        rows.append((peer, [html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", body, re.S)]))
    return rows


def test_metrics_dashboard_and_leaderboard_after_a_devnet(devnet_run):
    summary, seen, STEPS = devnet_run.summary, devnet_run.seen, devnet_run.steps
    assert summary["ok"] and "metrics" in seen, devnet_run.printed[-3000:]
    assert f"devnet: dashboard on {summary['metrics_urls']['trainer']}/" in devnet_run.printed
    ids = seen["ids"]

    for name, text in seen["metrics"].items():
        families = {f.name for f in text_string_to_metric_families(text)}
        assert ROLE_SERIES.get(name, {"p2pnet_peers_known"}) <= families, (name, ROLE_SERIES.get(name, set()) - families)
        if shutil.which("promtool"):
            checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            assert checked.returncode == 0, (name, checked.stdout + checked.stderr)
    assert all(body == "ok\n" for body in seen["health"].values())
    trainer = {f.name: f for f in text_string_to_metric_families(seen["metrics"]["trainer"])}
    assert trainer["p2pnet_trainer_step"].samples[0].value == STEPS
    verdicts = {(s.labels["result"], s.labels["reason"]): s.value
                for s in next(f for f in text_string_to_metric_families(seen["metrics"]["validator0"])
                              if f.name == "p2pnet_validator_verdicts").samples}
    assert verdicts[("accepted", "none")] >= STEPS and any(r == "rejected" for r, _ in verdicts)

    rows = [json.loads(line) for line in (devnet_run.root / "net" / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["tokens"] > 0 and "loss" in r and "reward_mean" in r and r["time"] > 0 for r in rows)

    # the leaderboard: the same from the CLI, the API and the devnet summary; real rows; the cheater got nothing
    assert seen["cli"].returncode == 0, seen["cli"].stderr
    board = json.loads(seen["cli"].stdout)["leaderboard"]
    assert board == seen["api_board"]["leaderboard"] == seen["api"]["leaderboard"]
    by_peer = {r["peer_id"]: r for r in board}
    honest = [by_peer[ids["worker1"]], by_peer[ids["worker2"]]]
    cheater, validator = by_peer[ids["worker0"]], by_peer[ids["validator0"]]
    assert {p["name"] for p in seen["api"]["peers"]} == set(ids)  # display names from the heartbeats
    assert ([h["name"] for h in honest], cheater["name"], validator["name"]) == (["worker1", "worker2"], "worker0", "validator0")
    assert sorted(h["rank"] for h in honest) == [1, 2] and all(h["accepted_tokens"] > 0 for h in honest)
    assert all(h["compute_s"] > 0 for h in honest)  # timed from the role's publish times (`Intake.published`)
    assert sum(h["trained_batches"] for h in honest) >= STEPS - 1  # a verified batch trained on nearly every step
    assert cheater["accepted_tokens"] == 0 and cheater["banned"] and cheater["rejected_batches"] >= 2
    assert validator["checks"] >= STEPS + 2
    assert [r["peer_id"] for r in summary["leaderboard"]] == [r["peer_id"] for r in board]
    assert [b["peer_id"] for b in seen["api"]["banned"]] == [ids["worker0"]]
    assert len(seen["api"]["steps"]) == STEPS and len(seen["api"]["peers"]) == len(ids) == 6

    if "dom" not in seen:
        pytest.skip("no headless browser (Debian package chromium; scripts/ops_deps.sh installs it as root)")
    run, shot = seen["shot"]
    assert run.returncode == 0 and shot.stat().st_size > 20_000, run.stderr[-2000:]
    dom = seen["dom"].stdout
    assert 'data-rendered="' in dom, seen["dom"].stderr[-2000:]
    rendered = leaderboard_rows_in(dom)
    api_rows = seen["dom_api"]["leaderboard"]
    assert [peer for peer, _ in rendered] == [r["peer_id"] for r in api_rows]
    for (peer, cells), row in zip(rendered, api_rows):
        assert cells[0] == str(row["rank"]) and cells[2] == row["name"] and cells[3] == str(row["accepted_tokens"])
        assert cells[4] == str(row["accepted_rollouts"]) and cells[9] == str(row["checks"])
        assert cells[8] == ("banned" if row["banned"] else "")
    for series in ("reward_mean", "loss", "tokens_per_s"):
        assert re.search(rf'data-series="{series}" data-points="{STEPS}"', dom), series


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

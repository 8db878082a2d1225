"""What the dashboard's data says and costs: strict JSON whatever the trainer logged, the spread of
a version measured against the peers whose holdings the trainer keeps (workers), and the
trainer's metrics file read from its end, once per change."""

from __future__ import annotations

import json
import math
import random

import trio

from p2pnet import dashboard
from p2pnet.dashboard import MAX_STEPS, StepRows, dashboard_data, json_body
from trainer import metricsfile
from trainer.metricsfile import METRICS_FILE, MetricsFile, read_metrics


def _strict(body: bytes):
    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(body, parse_constant=refuse)


def _peer(peer_id, roles):
    return {"peer_id": peer_id, "name": "", "roles": list(roles), "reachable": True, "upload_bps": 1.0,
            "download_bps": 1.0, "score": 0.0, "last_heard_s_ago": 0.1}


def _status(spread, history=(), peers=()):
    return {"peer_id": "T", "roles": ["trainer", "relay"], "connected": [], "peers": list(peers),
            "role_status": {"trainer": {"version": 1, "steps_target": 5, "done": False, "spread": spread,
                                        "leaderboard": [], "verdict_log": [], "history": list(history)}}}


def test_a_diverged_step_still_gives_the_page_json_it_can_parse(tmp_path):
    """One step whose loss is NaN (or inf) must not leave the page unable to update."""
    metrics = MetricsFile(tmp_path / METRICS_FILE)
    metrics.append({"step": 0, "loss": 0.5, "reward_mean": 0.1})
    metrics.append({"step": 1, "loss": math.nan, "reward_mean": math.inf})
    rows = trio.run(StepRows(tmp_path).rows)
    data = _strict(json_body(dashboard_data(_status({}), rows)))
    assert [(s["step"], s["loss"], s["reward_mean"]) for s in data["steps"]] == [(0, 0.5, 0.1), (1, None, None)]
    history = [{"step": 0, "loss": -math.inf}]  # the status itself (no file yet) is made strict too
    data = _strict(json_body(dashboard_data(_status({}, history=history))))
    assert data["steps"][0]["loss"] is None
    assert _strict(json_body({"deep": [{"x": math.nan}, (1.0, math.inf)]})) == {"deep": [{"x": None}, [1.0, None]]}


def test_time_to_all_counts_the_workers_whose_holdings_the_trainer_keeps():
    """Validators relay too, but the trainer keeps signed holdings from workers only: the time to
    all is when the last worker held the version."""
    spread = {"0": {"published_s": 0.0, "holders": {"w1": 2.0, "w2": 3.5}}}
    peers = [_peer("w1", ("worker", "relay")), _peer("w2", ("worker", "relay")), _peer("v", ("validator", "relay"))]
    [version] = dashboard_data(_status(spread, peers=peers))["versions"]
    assert version["time_to_all_s"] == 3.5 and version["holders_n"] == 2
    spread = {"0": {"published_s": 0.0, "holders": {"w1": 2.0}}}  # w2 has not got it yet
    assert dashboard_data(_status(spread, peers=peers))["versions"][0]["time_to_all_s"] is None


def test_the_metrics_file_is_read_from_its_end_and_only_again_when_it_changed(tmp_path, monkeypatch):
    metrics = MetricsFile(tmp_path / METRICS_FILE)
    for step in range(MAX_STEPS + 300):
        metrics.append({"step": step, "loss": 1.0, "workers": {"w": 1}})
    reads = []
    real = metricsfile.read_metrics
    monkeypatch.setattr(metricsfile, "read_metrics", lambda *a, **kw: reads.append(1) or real(*a, **kw))
    steps = StepRows(tmp_path)

    async def main():
        first = await steps.rows()
        again = await steps.rows()
        metrics.append({"step": MAX_STEPS + 300, "loss": 2.0})
        return first, again, await steps.rows()

    first, again, later = trio.run(main)
    assert [r["step"] for r in first] == list(range(300, MAX_STEPS + 300)) and again is first
    assert set(first[0]) == set(dashboard.STEP_FIELDS)  # only what the page draws is kept
    assert later[-1]["step"] == MAX_STEPS + 300 and len(reads) == 2


def test_reading_the_last_lines_matches_reading_the_whole_file(tmp_path, monkeypatch):
    """Whatever the blocks the end is read in cut through (a line, a multi-byte character, a line
    torn by a crash), the last rows are those of the whole file."""
    monkeypatch.setattr(metricsfile, "TAIL_BLOCK", 7)
    path = tmp_path / METRICS_FILE
    for trial in range(200):
        rng = random.Random(trial)
        rows = [{"step": i, "note": "é" * rng.randrange(12)} for i in range(rng.randrange(30))]
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + ('{"torn' if trial % 3 == 0 else "")
        path.write_text(text, encoding="utf-8")
        for last in (1, 2, 5, 40):
            expect = [json.loads(line) for line in text.splitlines()[-last:] if not line.startswith('{"torn')]
            assert read_metrics(path, last=last) == expect, (trial, last)

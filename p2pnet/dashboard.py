"""The live dashboard of a run and the contributors leaderboard: their data, and their commands.

`dashboard_data(status, steps)` turns a peer's status (`Node.status()`, as `p2pnet peer status
--json` prints it) and the trainer's per-step rows (`metrics.jsonl`) into everything the page
shows: the peers with their roles, reachability and advertised link capacity; each checkpoint
version's spread (seconds after its publish at which each peer announced, signed, that it holds
it, and the time until every worker did: the trainer keeps workers' holdings only); reward,
accuracy, loss and tokens per second by step; admitted verdicts by step; banned peers and why;
the leaderboard (`trainer.leaderboard`, counted by the trainer's intake from signed verdicts
only). On a trainer peer this is the whole run; on another peer, what that peer knows (its
peers, no curves).

The page (`dashboard.html`, beside this module) is one self-contained file: inline CSS and
JavaScript that draws its charts as SVG, no CDN, so it works offline. It polls `api/dashboard`
(`p2pnet.web`) every 2 s. It is served by any peer started with `--metrics-listen` and by
`p2pnet dashboard`, which reads a running peer through its control socket.

What a page load costs the peer: its status, built on its trio thread, and the newest rows of
`metrics.jsonl` (`StepRows`): read from the file's end in a worker thread, cut to the fields the
page draws, and read again only when the file changed, so a long run's file (tens of MB) does not
hold up the peer's gossip once per poll. Numbers that are not finite (a diverged step's loss) go
out as null: the page's JSON must parse.

`p2pnet leaderboard` prints the trainer's leaderboard. Nothing here changes a peer's state.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from p2pnet.cliargs import command, data_dir_argument, json_argument
from p2pnet.errors import ConfigError, PeerUnavailable

PAGE = Path(__file__).with_name("dashboard.html")
MAX_STEPS = 5000  # rows of metrics.jsonl the page gets (the newest)
STEP_FIELDS = ("step", "version", "time", "t_s", "reward_mean", "accuracy", "loss", "tokens", "tokens_per_s",
               "accepted_batches", "rejected_batches", "batches", "gather_s", "train_s", "trained")


@lru_cache(maxsize=1)
def page_html() -> bytes:
    return PAGE.read_bytes()


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def step_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The page's step rows from the trainer's per-step rows (`metrics.jsonl`'s, or its status
    history): the newest `MAX_STEPS`, cut to `STEP_FIELDS`, numbers that are not finite as None."""
    out = []
    for row in rows[-MAX_STEPS:]:
        step = {key: _finite(row.get(key)) for key in STEP_FIELDS}
        if step["tokens_per_s"] is None and row.get("tokens") is not None:
            wall_s = (row.get("gather_s") or 0) + (row.get("train_s") or 0)
            step["tokens_per_s"] = round(row["tokens"] / wall_s, 2) if wall_s > 0 else 0.0
        out.append(step)
    return out


def _versions(trainer: dict[str, Any], workers: set[str]) -> list[dict[str, Any]]:
    out = []
    for version, spread in sorted(trainer.get("spread", {}).items(), key=lambda kv: int(kv[0])):
        holders = spread["holders"]
        everyone = workers and workers <= set(holders)
        out.append({"version": int(version), "published_s": spread["published_s"], "holders": holders,
                    "holders_n": len(holders),
                    "time_to_all_s": max(holders[p] for p in workers) if everyone else None})
    return out


def _verdicts_by_step(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    counts: dict[int, dict[str, int]] = {}
    for entry in log:
        row = counts.setdefault(entry["step"], {"accepted": 0, "rejected": 0})
        row["accepted" if entry["accepted"] else "rejected"] += 1
    return [{"step": step, **row} for step, row in sorted(counts.items())]


def _banned(leaderboard: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in leaderboard:
        if row["banned"]:
            reasons = ", ".join(f"{code} x{n}" for code, n in row["rejection_reasons"].items()) or "failed checks"
            out.append({"peer_id": row["peer_id"], "why": f"validators rejected its batches: {reasons}",
                        "rejected_batches": row["rejected_batches"]})
    return out


def dashboard_data(status: dict[str, Any], steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Everything the page shows, from a peer's status and the trainer's step rows (`step_rows`
    of its metrics file: `StepRows`; without them, of the history in its status)."""
    trainer = status.get("role_status", {}).get("trainer")
    connected = set(status.get("connected", []))
    me = {"peer_id": status["peer_id"], "name": status.get("name", ""), "roles": status["roles"], "reachable": status.get("reachable"),
          "connected": True, "upload_bps": None, "download_bps": None, "score": 0.0, "last_heard_s_ago": 0.0,
          "self": True}
    relay = status.get("role_status", {}).get("relay") or {}
    if relay:
        me["upload_bps"] = relay.get("upload_advertised_bps")
    peers = [me] + [{"peer_id": p["peer_id"], "name": p.get("name", ""), "roles": p["roles"],
                     "reachable": p["reachable"],
                     "connected": p["peer_id"] in connected, "upload_bps": p["upload_bps"],
                     "download_bps": p["download_bps"], "score": p["score"],
                     "last_heard_s_ago": p["last_heard_s_ago"], "self": False} for p in status.get("peers", [])]
    workers = {p["peer_id"] for p in status.get("peers", []) if "worker" in p["roles"]}
    leaderboard = (trainer or {}).get("leaderboard", [])
    return {
        "generated_at": round(time.time(), 3),
        "self": {"peer_id": status["peer_id"], "roles": status["roles"], "uptime_s": status.get("uptime_s")},
        "trainer": None if trainer is None else {"version": trainer["version"], "steps_target": trainer["steps_target"],
                                                 "done": trainer["done"]},
        "peers": peers,
        "steps": steps or step_rows((trainer or {}).get("history", [])),
        "versions": _versions(trainer, workers) if trainer else [],
        "verdicts": _verdicts_by_step((trainer or {}).get("verdict_log", [])),
        "banned": _banned(leaderboard),
        "leaderboard": leaderboard,
    }


def json_body(data: Any) -> bytes:
    """`data` as strict JSON: a float that is not finite, wherever it hides, goes out as null."""
    try:
        return json.dumps(data, allow_nan=False).encode()
    except ValueError:
        return json.dumps(_all_finite(data), allow_nan=False).encode()


def _all_finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _all_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_all_finite(v) for v in value]
    return _finite(value)


class StepRows:
    """The page's step rows (`step_rows`) of a trainer's metrics file: read in a worker thread,
    from the file's end, and only again once its size or time changed."""

    def __init__(self, data_dir: Path) -> None:
        from trainer.metricsfile import METRICS_FILE

        self.path = data_dir / METRICS_FILE
        self._seen: tuple[int, int] | None = None
        self._rows: list[dict[str, Any]] = []
        self._lock = trio.Lock()

    async def rows(self) -> list[dict[str, Any]]:
        async with self._lock:  # polls that come together read the file once
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                return []
            if (st.st_size, st.st_mtime_ns) != self._seen:
                self._rows = await trio.to_thread.run_sync(self._read)
                self._seen = (st.st_size, st.st_mtime_ns)
            return self._rows

    def _read(self) -> list[dict[str, Any]]:
        from trainer.metricsfile import read_metrics

        return step_rows(read_metrics(self.path, last=MAX_STEPS))


def peer_snapshot(node: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """What builds the dashboard data of the running peer `node` (its own server, `p2pnet.web`)."""
    steps = StepRows(node.config.data_dir)

    async def snapshot() -> dict[str, Any]:
        return dashboard_data(node.status(), await steps.rows() if "trainer" in node.roles else [])

    return snapshot


# -- commands ---------------------------------------------------------------------------------


def register(commands: Any) -> None:
    dash = command(
        commands, "dashboard", "serve the live dashboard of a running peer (best: the trainer's)",
        description="A web page with the peers of the network and their roles, reachability and link capacity; "
        "each checkpoint version spreading; reward, loss and tokens per second; verdicts over time; banned "
        "peers; and the contributors leaderboard, refreshed every 2 s. It reads the peer running in --data-dir "
        "through its control socket, and the trainer's metrics.jsonl there. The page needs no internet. A peer "
        "started with --metrics-listen serves the same page itself.",
        example="p2pnet dashboard --data-dir ~/.p2pnet/trainer --listen 127.0.0.1:8080")
    data_dir_argument(dash, "data directory of the running peer to show")
    dash.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT",
                      help="serve the page here (default 127.0.0.1:8080; port 0 picks one)")
    dash.set_defaults(func=cmd_dashboard)

    board = command(
        commands, "leaderboard", "print the contributors leaderboard of a running trainer",
        description="Per peer: accepted rollouts and tokens, batches trained on, compute time, rejections and "
        "bans, validator checks done, bytes relayed to the trainer. Counted by the trainer's intake from signed "
        "verdicts only: what a peer says about itself is never counted.",
        example="p2pnet leaderboard --data-dir ~/.p2pnet/trainer --json")
    data_dir_argument(board, "data directory of the running trainer peer")
    json_argument(board)
    board.set_defaults(func=cmd_leaderboard)


async def _status(data_dir: Path) -> dict[str, Any]:
    from p2pnet.control import call

    reply = await call(data_dir, {"cmd": "status"}, timeout_s=10.0)
    if "error" in reply:
        raise PeerUnavailable(f"{data_dir}: {reply['error']}")
    return reply


def leaderboard_of(status: dict[str, Any], data_dir: Path) -> list[dict[str, Any]]:
    trainer = status.get("role_status", {}).get("trainer")
    if trainer is None:
        raise ConfigError("--data-dir", f"the peer in {data_dir} runs no trainer (roles: "
                          f"{', '.join(status.get('roles', [])) or 'none'}); the leaderboard is kept by the trainer: "
                          "give the trainer's data directory")
    return trainer.get("leaderboard", [])


def cmd_leaderboard(args: argparse.Namespace) -> int:
    rows = leaderboard_of(trio.run(_status, args.data_dir), args.data_dir)
    if args.json:
        print(json.dumps({"leaderboard": rows}, indent=2))
        return 0
    print(f"{'#':>3} {'peer':<54} {'tokens':>8} {'rollouts':>8} {'trained':>7} {'compute_s':>9} {'rejected':>8} "
          f"{'checks':>6}  banned")
    for r in rows:
        label = r["peer_id"] + (f" ({r['name']})" if r["name"] else "")
        print(f"{r['rank']:>3} {label:<54} {r['accepted_tokens']:>8} {r['accepted_rollouts']:>8} "
              f"{r['trained_batches']:>7} {r['compute_s']:>9.1f} {r['rejected_batches']:>8} {r['checks']:>6}  "
              f"{'yes' if r['banned'] else ''}")
    if not rows:
        print("(no contributions yet)")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from p2pnet.web import WebApp, serve

    steps = StepRows(args.data_dir)

    async def snapshot() -> dict[str, Any]:
        status = await _status(args.data_dir)
        rows = await steps.rows() if "trainer" in status.get("roles", []) else []
        return dashboard_data(status, rows)

    async def main(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await snapshot()  # a peer must run there now: say so at once, not on the first page load
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve, WebApp(snapshot=snapshot), args.listen, "--listen")
            print(f"dashboard on {url}/ (Ctrl-C stops)", flush=True)
            task_status.started()

    from p2pnet.cli import serve_until_signal

    trio.run(serve_until_signal, main)
    return 0

"""What operations cost a peer: Prometheus scrapes, and loading the dashboard with a big run.

    .venv/bin/python benchmarks/bench_ops.py [--window-s 30] [--peers 500] [--steps 1000]

Scrapes: three real `p2pnet peer start` processes (relay role) on loopback; peer 0 serves
/metrics (`--metrics-listen`). Its CPU time (utime + stime from /proc) is read over
`--window-s` seconds with no scrape, then over the same window with one scrape per second
(the figure the issue bounds: under 1% of a core), and the CPU cost of one scrape is measured
from 200 back-to-back scrapes. The trainer's part of a scrape grows with its step history, so
the collector is also timed in-process on a trainer role holding 1,000 steps of history.

Dashboard: a real devnet's recorded trainer status (`--recorded`, a JSON file of
`p2pnet peer status --json`, default: one is recorded by a 3-step devnet first) is scaled to
`--peers` peers and `--steps` steps of history, served by the dashboard's own app
(`p2pnet.web`), and opened in headless Chromium driven over its DevTools protocol in real time:
the page reports when its first render of the data ended (`performance.now()`, from navigation
start), beside the load event; the same page with one peer and one step is the baseline,
measured in the same run. Also: the time to build and encode `/api/dashboard`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pnet.localnet import start_network, wait_for_full_tables  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def scrape(url: str) -> bytes:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        return reply.read()


def scrape_cost(window_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-ops-") as tmp:
        peers = start_network(Path(tmp), 3, extra_args=["--metrics-listen", "127.0.0.1:0"],
                              roles_for={i: ("relay",) for i in range(3)})
        try:
            wait_for_full_tables(peers, timeout_s=60)
            url = peers[0].status()["metrics_url"]
            pid = peers[0].proc.pid
            size = len(scrape(url))
            time.sleep(2.0)
            start = cpu_s(pid)
            time.sleep(window_s)
            idle = (cpu_s(pid) - start) / window_s
            start, began = cpu_s(pid), time.monotonic()
            for i in range(int(window_s)):
                scrape(url)
                time.sleep(max(0.0, began + i + 1 - time.monotonic()))
            scraped = (cpu_s(pid) - start) / (time.monotonic() - began)
            start, began = cpu_s(pid), time.monotonic()
            for _ in range(200):
                scrape(url)
            burst_s = time.monotonic() - began
            per_scrape = (cpu_s(pid) - start - idle * burst_s) / 200
        finally:
            for p in peers:
                p.stop(timeout_s=15)
    return {"idle_cpu_share": idle, "scraped_cpu_share": scraped, "per_scrape_cpu_s": per_scrape,
            "scrape_bytes": size}


def trainer_collect_cost(steps: int) -> dict:
    """The trainer provider's families, rendered, with `steps` steps of history (in-process)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from trainer.metrics import TrainerMetrics

    history = [{"step": i, "version": i + 1, "trained": True, "reward_mean": 0.5, "accuracy": 0.5, "loss": 0.01,
                "batches": 3, "accepted_batches": 3, "rejected_batches": 0, "train_s": 0.3, "gather_s": 1.2,
                "tokens": 900, "t_s": float(i)} for i in range(steps)]
    ledger = SimpleNamespace(accepted=steps, rejected=2, trained_batches=steps, banned=False)
    role = SimpleNamespace(history=history, version=steps, config=SimpleNamespace(steps=steps),
                           intake=SimpleNamespace(workers={f"w{i}": ledger for i in range(16)}),
                           publish_timing={i + 1: {"write_s": 0.1, "publish_s": 0.01} for i in range(steps)},
                           propagation_s=lambda version: 0.8)
    provider = TrainerMetrics(None)

    class One:
        def collect(self):
            return provider.collect(role)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())
    runs = []
    for _ in range(50):
        began = time.process_time()
        generate_latest(registry)
        runs.append(time.process_time() - began)
    return {"trainer_collect_s": statistics.median(runs)}


# -- the dashboard -------------------------------------------------------------------------------


def record_devnet_status(root: Path) -> dict:
    from trainer.devnet import DevnetConfig, run_devnet

    seen: dict = {}

    def observe(procs):
        seen["status"] = procs["trainer"].status()

    run_devnet(DevnetConfig(steps=3, workers=2, byzantine=1, validators=1, relays=0), root,
               plot_to=root / "reward.png", observe=observe)
    return seen["status"]


def scaled(status: dict, peers: int, steps: int) -> tuple[dict, list]:
    """The recorded status with `peers` peers (copies of the recorded ones, new ids) and
    `steps` rows of history (the recorded rows, repeated with new step numbers)."""
    out = json.loads(json.dumps(status))
    recorded = status["peers"]
    out["peers"] = [dict(recorded[i % len(recorded)], peer_id=f"12D3KooWbench{i:06d}") for i in range(peers)]
    out["connected"] = [p["peer_id"] for p in out["peers"][:8]]
    trainer = out["role_status"]["trainer"]
    history = trainer["history"]
    rows = [dict(history[i % len(history)], step=i, version=i + 1, time=1.8e9 + i) for i in range(steps)]
    trainer["history"] = rows
    board = trainer["leaderboard"]
    trainer["leaderboard"] = [dict(board[i % len(board)], peer_id=p["peer_id"], rank=i + 1)
                              for i, p in enumerate(out["peers"])]
    log = trainer["verdict_log"]
    trainer["verdict_log"] = [dict(log[i % len(log)], step=i % steps) for i in range(1000)]
    return out, rows


def serve_in_thread(snapshot_data: dict) -> tuple[str, threading.Event]:
    import trio

    from p2pnet.web import WebApp, serve

    ready: dict = {}
    got = threading.Event()
    stop = threading.Event()

    async def snapshot():
        return snapshot_data

    async def main():
        async with trio.open_nursery() as nursery:
            ready["url"] = await nursery.start(serve, WebApp(snapshot=snapshot), "127.0.0.1:0")
            got.set()
            while not stop.is_set():
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    threading.Thread(target=trio.run, args=(main,), daemon=True).start()
    got.wait(30)
    return ready["url"], stop


def page_render_ms(browser: str, data: dict) -> tuple[float, float]:
    """(ms from navigation start until the page's first render ended, as the page measured it;
    the same for the load event), in a real-time headless Chromium driven over its DevTools
    protocol (no virtual time)."""
    import trio
    from trio_websocket import open_websocket_url

    url, stop = serve_in_thread(data)
    profile = tempfile.mkdtemp(prefix="bench-ops-chromium-")
    proc = subprocess.Popen([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--window-size=1400,1900", "--remote-debugging-port=0", f"--user-data-dir={profile}",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
            target = next(t for t in json.loads(reply.read()) if t["type"] == "page")

        async def drive() -> tuple[float, float]:
            async with open_websocket_url(target["webSocketDebuggerUrl"], max_message_size=64 * 2**20) as ws:
                ids = iter(range(1, 10**6))

                async def call(method: str, **params):
                    my_id = next(ids)
                    await ws.send_message(json.dumps({"id": my_id, "method": method, "params": params}))
                    while True:
                        message = json.loads(await ws.get_message())
                        if message.get("id") == my_id:
                            return message.get("result", {})

                await call("Page.enable")
                await call("Page.navigate", url=url + "/")
                expression = ("[document.body && document.body.getAttribute('data-first-render-ms'), "
                              "performance.getEntriesByType('navigation')[0]?.loadEventEnd || 0]")
                with trio.fail_after(60):
                    while True:
                        result = await call("Runtime.evaluate", expression=expression, returnByValue=True)
                        rendered, load = result["result"]["value"]
                        if rendered:
                            return float(rendered), float(load)
                        await trio.sleep(0.02)

        return trio.run(drive)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


def dashboard_cost(recorded: dict, peers: int, steps: int) -> dict:
    from p2pnet.dashboard import dashboard_data, step_rows

    big, rows = scaled(recorded, peers, steps)
    builds = []
    for _ in range(20):
        began = time.perf_counter()
        data = dashboard_data(big, step_rows(rows))
        body = json.dumps(data).encode()
        builds.append(time.perf_counter() - began)
    out: dict[str, float | str] = {"api_build_s": statistics.median(builds), "api_bytes": len(body)}
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
                   None)
    if browser is None:
        out["browser"] = "no headless browser here (Debian package chromium)"
        return out
    small, small_rows = scaled(recorded, 1, 1)
    empty = dashboard_data(small, step_rows(small_rows))
    base = [page_render_ms(browser, empty) for _ in range(3)]
    full = [page_render_ms(browser, data) for _ in range(3)]
    out.update(render_ms_small=statistics.median(r[0] for r in base), render_ms_big=statistics.median(r[0] for r in full),
               load_ms_small=statistics.median(r[1] for r in base), load_ms_big=statistics.median(r[1] for r in full))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--peers", type=int, default=500)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--recorded", type=Path, help="a trainer's `p2pnet peer status --json` (default: record one)")
    parser.add_argument("--save-recorded", type=Path, help="write the recorded status here, for --recorded")
    parser.add_argument("--skip-scrapes", action="store_true", help="measure the dashboard only")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if not args.skip_scrapes:
        report_scrapes(args)
    if args.recorded:
        recorded = json.loads(args.recorded.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="bench-ops-devnet-") as tmp:
            recorded = record_devnet_status(Path(tmp))
        if args.save_recorded:
            args.save_recorded.write_text(json.dumps(recorded))
    report_dashboard(args, recorded)
    return 0


def report_scrapes(args: argparse.Namespace) -> None:
    scrapes = scrape_cost(args.window_s)
    print(f"scrape: {scrapes['scrape_bytes']} bytes; peer CPU idle {scrapes['idle_cpu_share'] * 100:.2f}% of a core, "
          f"with 1 scrape/s {scrapes['scraped_cpu_share'] * 100:.2f}%; one scrape costs "
          f"{scrapes['per_scrape_cpu_s'] * 1000:.2f} ms CPU = {scrapes['per_scrape_cpu_s'] * 100:.3f}% of a core at 1/s")
    trainer = trainer_collect_cost(args.steps)
    print(f"trainer families with {args.steps} steps of history: {trainer['trainer_collect_s'] * 1000:.2f} ms CPU "
          "per scrape (in-process)")


def report_dashboard(args: argparse.Namespace, recorded: dict) -> None:
    dash = dashboard_cost(recorded, args.peers, args.steps)
    print(f"dashboard with {args.peers} peers and {args.steps} steps: /api/dashboard built and encoded in "
          f"{dash['api_build_s'] * 1000:.1f} ms, {dash['api_bytes'] / 1e6:.2f} MB")
    if "render_ms_big" in dash:
        print(f"  Chromium, median of 3: page loaded (load event) {dash['load_ms_big']:.0f} ms and its data rendered "
              f"{dash['render_ms_big']:.0f} ms after navigation start (1 peer, 1 step: {dash['load_ms_small']:.0f} "
              f"and {dash['render_ms_small']:.0f} ms)")
    else:
        print(f"  {dash['browser']}")


if __name__ == "__main__":
    sys.exit(main())

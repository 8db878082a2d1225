"""A peer's /metrics, /healthz and dashboard API over real HTTP, and `--log-format json`."""

import json
import logging
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from p2pnet.cli import configure_logging
from p2pnet.host import adopt_libp2p_logging
from p2pnet.localnet import start_network, wait_for_full_tables
from p2pnet.logformat import event_name, set_log_context
from p2pnet.metrics import health
from p2pnet.web import WebApp, serve

FAST = ["--heartbeat-interval-s", "0.3", "--peer-expiry-s", "3"]
PEER_SERIES = {"p2pnet_peer_info", "p2pnet_peers_known", "p2pnet_peers_connected", "p2pnet_gossip_messages_received",
               "p2pnet_gossip_messages_sent", "p2pnet_gossip_messages_rejected", "p2pnet_peer_healthy",
               "p2pnet_relay_bytes_served", "p2pnet_relay_bytes_received", "p2pnet_relay_chunks_verified",
               "p2pnet_relay_chunks_rejected", "p2pnet_relay_versions_held", "p2pnet_http_connections",
               "p2pnet_http_connections_refused", "p2pnet_http_connections_evicted",
               "p2pnet_http_connections_failed", "p2pnet_http_connections_trusted"}


def get(url, timeout=10):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def promtool_check(text):
    """`promtool check metrics` on `text`; None when promtool is missing (the caller skips)."""
    if shutil.which("promtool") is None:
        return None
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)


def test_health_says_why_not():
    starting = SimpleNamespace(roles_running=False, roles={})
    assert health(starting) == "starting: roles not running yet"
    full = SimpleNamespace(unhealthy=lambda role: "chunk store full or failing: fetching is held")
    running = SimpleNamespace(roles_running=True, roles={"relay": object()})
    assert health(running, {"relay": full}) == "relay: chunk store full or failing: fetching is held"
    assert health(running, {"relay": SimpleNamespace(unhealthy=lambda role: None)}) is None


def test_json_logs_carry_time_level_peer_role_and_event_also_for_libp2p(capsys):
    # as in a running peer: py-libp2p imported (its import stops its loggers propagating, and any
    # earlier test may have imported it) and its logging adopted, as opening a host does
    import libp2p  # noqa: F401

    adopt_libp2p_logging()
    set_log_context("12D3KooWexample", ("relay", "worker"))
    try:
        configure_logging("info", "json")
        logging.getLogger("libp2p.network.swarm").warning("dial to %s failed: %s", "peer-x", "refused")
        logging.getLogger("trainer.roles").info("worker: version %d is gone", 3)
        logging.getLogger("relay.role").error("chunk %d rotten", 4, extra={"event": "chunk_rotten"})
    finally:
        configure_logging("warning")
        set_log_context("", ())
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert len(lines) == 3
    for line in lines:
        assert set(line) >= {"time", "level", "peer_id", "role", "event", "logger", "message"}
        assert line["peer_id"] == "12D3KooWexample" and line["time"].endswith("Z")
    libp2p, worker, relay = lines
    assert libp2p["logger"] == "libp2p.network.swarm" and libp2p["level"] == "WARNING"
    assert libp2p["event"] == "dial_to_failed" and libp2p["message"] == "dial to peer-x failed: refused"
    assert (worker["role"], worker["event"]) == ("worker", "worker_version_is_gone")
    assert (relay["role"], relay["event"]) == ("relay", "chunk_rotten")
    assert event_name("%(n)d peers of %s") == "peers_of"


@pytest.mark.slow
def test_peers_serve_metrics_health_and_dashboard_api(tmp_path):
    peers = start_network(tmp_path, 2, extra_args=[*FAST, "--metrics-listen", "127.0.0.1:0", "--log-format", "json"],
                          roles_for={0: ("relay",), 1: ("relay",)})
    try:
        wait_for_full_tables(peers, timeout_s=30)
        url = peers[0].status()["metrics_url"]
        assert url.startswith("http://127.0.0.1:")
        assert get(url + "/healthz") == (200, "ok\n")
        code, text = get(url + "/metrics")
        assert code == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert PEER_SERIES <= set(families), PEER_SERIES - set(families)
        assert families["p2pnet_peers_known"].samples[0].value == 1
        assert families["p2pnet_peer_info"].samples[0].labels["peer_id"] == peers[0].peer_id
        assert families["p2pnet_gossip_messages_received"].samples[0].value > 0  # heartbeats of peer1
        assert families["p2pnet_http_connections"].samples[0].value >= 1  # this scrape's
        checked = promtool_check(text)
        if checked is not None:
            assert checked.returncode == 0, checked.stdout + checked.stderr
        code, body = get(url + "/api/dashboard")
        data = json.loads(body)
        assert code == 200 and {p["peer_id"] for p in data["peers"]} == {p.peer_id for p in peers}
        code, page = get(url + "/")
        assert code == 200 and "<svg" in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
        assert get(url + "/nope")[0] == 404
        check_dashboard_command(peers[1])
    finally:
        codes = [p.stop(timeout_s=15) for p in peers]
    assert codes == [0, 0]
    records = [json.loads(line) for line in peers[0].log_path.read_text().splitlines() if line.strip()]
    assert records and all({"time", "level", "peer_id", "role", "event"} <= set(r) for r in records)
    assert any(r["logger"] == "p2pnet.web" and r["message"].startswith("serving http://") for r in records)
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus; scripts/ops_deps.sh installs it as root)")


def check_dashboard_command(peer):
    """`p2pnet dashboard` serves the page and API of a peer running elsewhere (through its control
    socket); `p2pnet leaderboard` on a peer without the trainer role says whose data dir to give."""
    proc = subprocess.Popen([sys.executable, "-m", "p2pnet", "dashboard", "--data-dir", str(peer.data_dir),
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("dashboard on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[2].rstrip("/")
        code, body = get(url + "/api/dashboard")
        assert code == 200 and json.loads(body)["self"]["peer_id"] == peer.peer_id
        assert get(url + "/")[0] == 200 and get(url + "/metrics")[0] == 404  # metrics are the peer's own
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    board = subprocess.run([sys.executable, "-m", "p2pnet", "leaderboard", "--data-dir", str(peer.data_dir)],
                           capture_output=True, text=True, timeout=60)
    assert board.returncode == 2 and "runs no trainer" in board.stderr and len(board.stderr.splitlines()) == 1


async def test_an_app_error_is_a_500_and_a_record_with_its_traceback(nursery, caplog):
    """A failing page (the peer behind `p2pnet dashboard` gone) is answered 500 and logged with its
    traceback by `p2pnet.web` (through the peer's handlers and format, --log-format), before the
    answer; hypercorn, which logged it once, now has nothing of it to log."""
    async def snapshot():
        raise RuntimeError("the peer is gone")

    url = await nursery.start(serve, WebApp(snapshot=snapshot), "127.0.0.1:0")
    code, _ = await trio.to_thread.run_sync(get, url + "/api/dashboard")
    assert code == 500
    assert any(r.name == "p2pnet.web" and r.exc_info and "the peer is gone" in str(r.exc_info[1])
               for r in caplog.records)
    assert (await trio.to_thread.run_sync(get, url + "/healthz"))[0] == 404  # and it serves on
    nursery.cancel_scope.cancel()


async def test_what_hypercorn_logs_goes_through_our_handlers_not_its_own(nursery, caplog):
    """hypercorn logs through `hypercorn.error`, which `serve` hands it so that the peer's handlers
    and format (--log-format) carry its records; left to itself, hypercorn puts a handler of its own
    on that logger (stderr, its own format), so each of its lines would come out twice, once bare.
    What it logs once serving is an error that escapes the application (a failing page is answered
    by WebApp, so only a failure to answer would)."""
    hypercorn_log = logging.getLogger("hypercorn.error")
    handlers = list(hypercorn_log.handlers)

    class Escaping(WebApp):
        async def __call__(self, scope, receive, send):
            raise RuntimeError("not answered")

    async def snapshot():
        return {}

    url = await nursery.start(serve, Escaping(snapshot=snapshot), "127.0.0.1:0")
    code, _ = await trio.to_thread.run_sync(get, url + "/healthz")
    assert code == 500
    assert any(r.name == "hypercorn.error" and r.exc_info and "not answered" in str(r.exc_info[1])
               for r in caplog.records)
    assert hypercorn_log.handlers == handlers  # hypercorn added none of its own
    nursery.cancel_scope.cancel()


def test_metrics_listen_errors_are_one_line(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "p2pnet", "peer", "start", "--data-dir", str(tmp_path / "a"),
                          "--metrics-listen", "9100"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "metrics_listen" in bad.stderr and "HOST:PORT" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        busy = subprocess.run([sys.executable, "-m", "p2pnet", "peer", "start", "--data-dir", str(tmp_path / "b"),
                               "--metrics-listen", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2 and "cannot listen" in busy.stderr, busy.stderr
    assert len(busy.stderr.strip().splitlines()) == 1

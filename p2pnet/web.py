"""The peer's small HTTP server: `/metrics`, `/healthz`, and the dashboard's page and JSON API.

A plain ASGI application served by hypercorn's trio worker inside the peer's own trio run, in
the node's nursery (so it stops with the peer and never blocks it: a request is a trio task,
and a scrape only reads state). Routes:

    GET /metrics          Prometheus text format (`p2pnet.metrics`)
    GET /healthz          200 "ok" while the peer runs its roles; 503 and the reason otherwise
    GET /                 the dashboard page (`p2pnet.dashboard`), one self-contained HTML file
    GET /api/dashboard    everything the page shows, as JSON
    GET /api/leaderboard  the contributors leaderboard, as JSON

The same application serves `p2pnet dashboard` (a separate process reading a running peer
through its control socket): it is built from callables, not from a node. This module owns
routing and the socket; what a page or a metric says belongs to the modules named above.
"""

from __future__ import annotations

import json
import logging
import socket
from typing import Any, Awaitable, Callable

import trio

from p2pnet.addresses import join_host_port, parse_host_port
from p2pnet.errors import ConfigError

log = logging.getLogger(__name__)

Snapshot = Callable[[], Awaitable[dict[str, Any]]]
JSON_TYPE = b"application/json"


class WebApp:
    """An ASGI application over four callables: `metrics()` (bytes) and `health()` (None or a
    reason), both None when this server has no metrics; `snapshot()` (async: the dashboard
    data) and `page()` (the HTML)."""

    def __init__(self, *, snapshot: Snapshot, metrics: Callable[[], bytes] | None = None,
                 health: Callable[[], str | None] | None = None) -> None:
        self.metrics = metrics
        self.health = health
        self.snapshot = snapshot

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        status, content_type, body = await self.respond(scope["method"], scope["path"])
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                   (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body if scope["method"] != "HEAD" else b""})

    async def respond(self, method: str, path: str) -> tuple[int, bytes, bytes]:
        from p2pnet.dashboard import page_html
        from p2pnet.metrics import CONTENT_TYPE

        if method not in ("GET", "HEAD"):
            return 405, b"text/plain", b"only GET\n"
        if path == "/metrics" and self.metrics is not None:
            return 200, CONTENT_TYPE.encode(), self.metrics()
        if path == "/healthz" and self.health is not None:
            reason = self.health()
            return (200, b"text/plain", b"ok\n") if reason is None else (503, b"text/plain", f"{reason}\n".encode())
        if path in ("/", "/index.html"):
            return 200, b"text/html; charset=utf-8", page_html()
        if path == "/api/dashboard":
            return 200, JSON_TYPE, json.dumps(await self.snapshot()).encode()
        if path == "/api/leaderboard":
            data = await self.snapshot()
            return 200, JSON_TYPE, json.dumps({"leaderboard": data.get("leaderboard", [])}).encode()
        return 404, b"text/plain", b"not found; try /, /metrics, /healthz, /api/dashboard, /api/leaderboard\n"


def bind(listen: str, field: str) -> socket.socket:
    """A listening TCP socket on `listen` (HOST:PORT, port 0 picks one); ConfigError naming
    `field` when it cannot be had (port in use, address not ours)."""
    host, port = parse_host_port(listen, field)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(field, f"cannot listen on {listen}: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock


async def serve(app: WebApp, listen: str, field: str = "--listen",
                task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on `listen` until cancelled; `task_status.started("http://HOST:PORT")`."""
    from hypercorn.config import Config, Sockets
    from hypercorn.trio.run import worker_serve
    from hypercorn.utils import wrap_app

    sock = bind(listen, field)
    host, port = sock.getsockname()[:2]
    config = Config()
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # through our handlers and format (--log-format)
    config.keep_alive_timeout = 30
    url = f"http://{join_host_port(host, port)}"

    async def started(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await worker_serve(wrap_app(app, config.wsgi_max_body_size, "asgi"), config,
                           sockets=Sockets([], [sock], []), task_status=task_status)

    async with trio.open_nursery() as nursery:
        await nursery.start(started)
        log.info("serving %s", url)
        task_status.started(url)


async def serve_peer_http(node: Any, listen: str,
                          task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """The running peer's server ([peer] metrics_listen): its metrics, health and dashboard."""
    from p2pnet.dashboard import peer_snapshot
    from p2pnet.metrics import PeerCollector, render
    from prometheus_client import CollectorRegistry

    collector = PeerCollector(node)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    async def snapshot() -> dict[str, Any]:
        return peer_snapshot(node)

    app = WebApp(snapshot=snapshot, metrics=lambda: render(registry), health=collector.health)
    await serve(app, listen, "peer.metrics_listen", task_status=task_status)

"""The peer's small HTTP server: `/metrics`, `/healthz`, and the dashboard's page and JSON API.

A plain ASGI application served by hypercorn's trio connection server inside the peer's own
trio run, in the node's nursery (so it stops with the peer and never blocks it: a request is a
trio task, and a scrape only reads state). Routes:

    GET /metrics          Prometheus text format (`p2pnet.metrics`)
    GET /healthz          200 "ok" while the peer runs its roles; 503 and the reason otherwise
    GET /                 the dashboard page (`p2pnet.dashboard`), one self-contained HTML file
    GET /api/dashboard    everything the page shows, as JSON
    GET /api/leaderboard  the contributors leaderboard, as JSON

No route takes a request body. A request that declares one (a Content-Length other than 0, or
any Transfer-Encoding) is answered at once, 405 when its method is not GET or HEAD and 413 when
it is, its connection closed; whatever body arrives meanwhile, declared or not (an HTTP/2 stream
needs no header to carry one), is read and dropped while the request is answered
(`WebApp.__call__`), so hypercorn's queue of what the application has not read never fills (a
page that fails is answered there too, 500, its traceback logged, the body dropped meanwhile). A
client that asks leave to send its body (`Expect: 100-continue`) is not given it: the refusal is
its first answer (`NoContinue`). An HTTP/2 connection closed because its client sends a body on
past the answer says so first, with a GOAWAY (`ConnectionServer._go_away`).

The same application serves `p2pnet dashboard` (a separate process reading a running peer
through its control socket): it is built from callables, not from a node. This module owns
routing, the socket and hypercorn's settings; what a page or a metric says belongs to the
modules named above. The server may face the internet, so its connections are accepted within
the bounds of `p2pnet.web_limits` (connections per client and in all, a share of them kept for
the operator's own networks, a deadline for each request, a lifetime for each connection)
before hypercorn sees them, and what a client sends must never end in a traceback in our log
nor stop the server (`ConnectionServer`; a websocket is closed unanswered, `refuse_websocket`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
from typing import Any, Awaitable, Callable

import h11
import h2.errors
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import wrap_app

from p2pnet.addresses import join_host_port, parse_host_port
from p2pnet.errors import ConfigError
from p2pnet.web_limits import KEEP_ALIVE_MAX_REQUESTS, Busy, Connections, trusting, wide_network_warnings

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
        if scope["type"] != "http":  # `serve` runs no lifespan and refuses websockets before this
            return
        with_body = declares_body(scope["headers"])
        failed = False
        async with trio.open_nursery() as nursery:
            # hypercorn queues what a client sends for the application to read, 10 messages deep, and
            # its connection's reader waits while the queue is full, as does the end of the response
            # (it queues the request's end there): a body we never read, larger than that, stopped
            # both, and its connection was held until the lifetime's reset. What arrives is dropped
            # as it comes, until the request's end, which hypercorn queues once the response is sent
            # or the connection closes (and that ends this nursery).
            nursery.start_soon(drop_body, receive)
            try:
                status, content_type, body = await self.respond(scope["method"], scope["path"], with_body)
            except Exception:  # a failing page (a bug of ours, or the peer behind `p2pnet dashboard` gone)
                # answered here, not raised for hypercorn's 500: that came only once the application had
                # returned, when nothing dropped the body any more, so an undeclared HTTP/2 body filled
                # the queue while the 500 went out, and the end of its stream, queueing the request's end,
                # waited on the full queue with the reader until the lifetime's reset (measured with 1-byte
                # DATA frames: 8 or 9 of the 10 places taken by then; 1 checkpoint more on that path held
                # the connection in 1 run of 3, 2 in every run). Logged before the answer, as hypercorn did
                log.exception("%s %s failed", scope["method"], scope["path"])
                failed = True
                status, content_type, body = 500, b"text/plain", b"internal error\n"
            headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                       (b"cache-control", b"no-store")]
            if status == 405:
                headers.append((b"allow", b"GET, HEAD"))  # RFC 9110 (15.5.6): a 405 names what is allowed
            if (with_body or failed) and scope["http_version"] in ("1.0", "1.1"):
                # the connection ends with this response: hypercorn would keep it when the whole body
                # had arrived before the response ended (HTTP/2 has no such header; the stream ends);
                # after a failure, as hypercorn's own 500 ended it
                headers.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body if scope["method"] != "HEAD" else b""})

    async def respond(self, method: str, path: str, with_body: bool = False) -> tuple[int, bytes, bytes]:
        """The status, content type and body answering `method` on `path`; `with_body` when the
        request declares a body, which no route takes."""
        from p2pnet.dashboard import json_body, page_html
        from p2pnet.metrics import CONTENT_TYPE

        if method not in ("GET", "HEAD"):
            return 405, b"text/plain", b"only GET and HEAD\n"
        if with_body:
            return 413, b"text/plain", b"no request body is taken here\n"
        if path == "/metrics" and self.metrics is not None:
            return 200, CONTENT_TYPE.encode(), self.metrics()
        if path == "/healthz" and self.health is not None:
            reason = self.health()
            return (200, b"text/plain", b"ok\n") if reason is None else (503, b"text/plain", f"{reason}\n".encode())
        if path in ("/", "/index.html"):
            return 200, b"text/html; charset=utf-8", page_html()
        if path == "/api/dashboard":
            return 200, JSON_TYPE, json_body(await self.snapshot())
        if path == "/api/leaderboard":
            data = await self.snapshot()
            return 200, JSON_TYPE, json_body({"leaderboard": data.get("leaderboard", [])})
        return 404, b"text/plain", b"not found; try /, /metrics, /healthz, /api/dashboard, /api/leaderboard\n"


def declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's headers (lower-case names, as hypercorn gives them) announce a body:
    a Content-Length other than 0, or a Transfer-Encoding."""
    return any(name == b"transfer-encoding" or (name == b"content-length" and value.strip().lstrip(b"0"))
               for name, value in headers)


async def drop_body(receive: Any) -> None:
    """Read and drop what a request sends, until hypercorn says the request is over."""
    while (await receive())["type"] != "http.disconnect":
        pass


class NoContinue(h11.Connection):
    """h11's server side of an HTTP/1.1 connection that never answers `Expect: 100-continue` with
    a 100 (Continue). hypercorn sends one as soon as h11 says a client waits for it, which is
    once it has read the request's head (`H11Protocol._handle_events`, the same in 0.17.0 to
    0.18.0), before the application has seen the request: a client that asked leave to send a
    body (curl does for bodies over 1 MiB) got the leave, sent the body, and only then heard the
    413 or 405 refusing it. No route takes a body, so none is ever invited: a request that
    declares one hears its final status first (RFC 9110 15.2.1 and 10.1.1: a server may answer
    with one instead of the 100, and need not send a 100 for a request without content). h11
    itself does not read this property (it keeps its own `client_is_waiting_for_100_continue`);
    HTTP/2 has no such step in hypercorn, which sends no 100 there."""

    @property
    def they_are_waiting_for_100_continue(self) -> bool:
        return False


class ConnectionServer(TCPServer):
    """hypercorn's server of one connection, which ends as soon as its client has gone.

    hypercorn's one public entry (`hypercorn.trio.serve`, `worker_serve`) accepts every
    connection it is offered, so `serve` accepts them itself (`Connections.serve`) and hands each
    admitted one to `TCPServer`, which is not public API (the same in hypercorn 0.17.0 to 0.18.0,
    which pyproject.toml pins; it is annotated to take an SSLStream and takes a plain stream, which
    has no `do_handshake`). Its read loop ends when the client leaves, but when the client left
    an idle connection (before its first request or between two) the connection then waited for
    its idle timer, holding a slot for up to `idle_s` after the client had gone. Each connection
    gets its own WorkerContext, and setting its `terminated` (hypercorn's graceful-shutdown
    signal) when the read loop ends closes the connection at once, or after the response in
    flight. And `TCPServer._close` sends its end of stream outside the lock its writes take
    (`send_lock`), so when a connection was closed while a response was being written (a client
    that sends more after a request that asked to close, or pipelines past
    `KEEP_ALIVE_MAX_REQUESTS`: hypercorn closes on the protocol error) the two met on the socket
    and one raised BusyResourceError: in the application's task hypercorn logged it as an error
    of ours ("Error in ASGI Framework"), in the read loop's it ended the whole server. The end
    of stream here waits for the write in flight.

    That lock only orders two writes: the close still came between a response's head and its
    body when the read loop met a protocol error after the head was sent. A pipelining client's
    request past `KEEP_ALIVE_MAX_REQUESTS` does that (the head of the last response says
    Connection: close, after which h11 takes any byte as the client's error), so about half of
    such clients lost the body of the last response they were promised. A close the read loop
    asks for while a response is half sent (h11's SEND_BODY, its stream not yet closed) now waits
    for the application's side to end that response, which closes the connection itself (h11
    leaves it nothing else to do); the read loop reads nothing meanwhile, so what the client
    sends is not buffered. The lifetime's reset still ends a client that does not read. Nor is
    the socket closed with bytes of the client's unread: Linux then resets it, and a reset can
    drop what the client had not yet read (shown with plain sockets: of 2,807,808 bytes sent, 4,096
    arrived). After our end of stream the read loop reads and drops what comes until the client
    closes its end, as RFC 9112 (9.6) asks, for at most `keep_alive_timeout`. Through this server,
    without it, a last response once arrived 848 bytes short of its 1 MiB and, in one run, 6 of 10
    clients pipelining past the limit saw a reset after their last byte (none with it). Those
    clients read as the responses came, so the close rarely found a response undelivered; one
    that reads nothing until the server has read what it sent past the limit, or reset it, lost
    its last responses every time without the linger (test_web_limits.py, "not reset away").
    And an HTTP/2 connection's closing did not wake the writers of its unfinished responses
    (`_release_http2_streams`), and a DATA frame for a stream already answered (a body no route
    takes, sent past our answer) raised KeyError in hypercorn's reader, which ended the connection
    as a failure of ours; such a connection now ends as HTTP/1.1's does then, closed after the
    answer (`_data_for_a_stream_answered`), with a GOAWAY first (`_go_away`, through `H2Protocol`'s
    `connection`). And an HTTP/1.1 connection's h11 state, `H11Protocol.connection`, is replaced
    before its first byte is read by one that never asks for a body (`NoContinue`), which hypercorn
    keeps for the connection's next requests (`start_next_cycle` reuses it).
    tests/p2pnet/test_web_limits.py and test_web_refusals.py serve every request through this class
    and fail if any of those internals changes; the first checks the pin."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._response_ended = trio.Event()
        self._read_scope = trio.CancelScope()
        self._read_ended = trio.Event()
        self._linger_until = math.inf  # once our end of stream is sent: until then the client may send

    async def _read_data(self) -> None:
        """hypercorn's read loop (without its read_timeout, which `serve` leaves unset), lingering
        once our end of stream is sent: what the client sends then is read and dropped until it
        closes, or `keep_alive_timeout` after our end of stream, so that the close finds nothing
        unread (the kernel resets a socket closed with unread bytes, and drops with it what it
        had not yet delivered of the last response). An HTTP/1.1 connection (every one starts as
        one) never invites a body (`NoContinue`); nothing has been read yet, so nothing is lost."""
        protocol = self.protocol.protocol
        if isinstance(protocol, H11Protocol):
            protocol.connection = NoContinue(h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size)
        while True:
            with trio.CancelScope(deadline=self._linger_until) as self._read_scope:
                try:
                    data = await self.stream.receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
            if self._read_scope.cancelled_caught:
                break
            if self._linger_until == math.inf:  # b"" too: h11 then knows the client has closed its end
                try:
                    await self.protocol.handle(RawData(bytes(data)))
                except KeyError as exc:
                    if not self._data_for_a_stream_answered(exc):
                        raise
                    await self._go_away(exc.args[0])
                    await self.protocol_send(Closed())  # our end of stream; what follows is dropped
            if not data:
                break
        await self.protocol.handle(Closed())
        await self._release_http2_streams()
        self._read_ended.set()
        await self.context.terminated.set()

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, Closed) and self._response_half_sent():
            self._response_ended = trio.Event()
            await self._response_ended.wait()
        await super().protocol_send(event)
        if not self._response_half_sent():  # its end sent, or its client gone (a failed write closes the stream)
            self._response_ended.set()
        await self._release_http2_streams()

    async def _release_http2_streams(self) -> None:
        """Once an HTTP/2 connection is closed, wake its responses' writers: each waits on its
        stream's buffer for the task that sends (`send_task`), which has ended, so an application
        that had not sent its whole response when the connection closed (an h2c upgrade followed by
        bytes that are not HTTP/2, a protocol error, a client gone) waited, and held its connection,
        until the lifetime's reset. A closed buffer takes nothing more and lets its writer go."""
        protocol = self.protocol.protocol
        if isinstance(protocol, H2Protocol) and protocol.closed:
            for buffer in protocol.stream_buffers.values():
                await buffer.close()

    def _data_for_a_stream_answered(self, exc: KeyError) -> bool:
        """Whether `exc` is hypercorn's HTTP/2 reader meeting a request's body after its response
        ended (it forgets the stream then, and looks it up for each DATA frame): a client that
        sends a body no route takes, past our answer. Raised by that lookup itself (the innermost
        frame is hypercorn's loop over h2's events), not by anything it calls: a KeyError of ours
        met there, or of h2's, is still the bug it is."""
        protocol = self.protocol.protocol
        innermost = exc.__traceback__
        while innermost is not None and innermost.tb_next is not None:
            innermost = innermost.tb_next
        return (isinstance(protocol, H2Protocol) and innermost is not None
                and innermost.tb_frame.f_code is H2Protocol._handle_events.__code__
                and len(exc.args) == 1 and isinstance(exc.args[0], int) and exc.args[0] not in protocol.streams)

    async def _go_away(self, answered: int) -> None:
        """An HTTP/2 GOAWAY before the end of stream of a connection closed for a body sent past its
        answer on stream `answered` (`_data_for_a_stream_answered`): without it its client could not
        tell a close on purpose from a connection lost, nor which of its streams were processed (RFC
        9113 6.8). The last stream it names is `answered`, not h2's default (the highest the client
        opened): with one stream at a time (`serve`), a stream opened after it can only have come in
        the same read, once that body had ended it, and hypercorn drops the rest of the read's
        events, so no such stream reached the application; naming it would tell its client that a
        request nobody saw might have been processed, which it then may not retry. NO_ERROR: a body
        sent on after the answer breaks no rule, it is only one we do not read. What hypercorn had
        not yet flushed of that read's events (window updates) goes out before it, in h2's order."""
        protocol = self.protocol.protocol
        if isinstance(protocol, H2Protocol):  # always, after `_data_for_a_stream_answered`
            protocol.connection.close_connection(error_code=h2.errors.ErrorCodes.NO_ERROR, last_stream_id=answered)
            await self.protocol_send(RawData(protocol.connection.data_to_send()))

    def _response_half_sent(self) -> bool:
        """A response's head is sent, its end is not, and its stream is open (the application's
        side ends it, and closes the connection, as `_maybe_recycle` does after the stream)."""
        protocol = self.protocol.protocol
        return (isinstance(protocol, H11Protocol) and protocol.stream is not None
                and protocol.connection.our_state is h11.SEND_BODY)

    async def _close(self) -> None:
        """Our end of stream after the write in flight, then the socket closed once the client
        has closed its end (the read loop lingers until then, within `keep_alive_timeout`)."""
        async with self.send_lock:
            if self._linger_until == math.inf:
                self._linger_until = trio.current_time() + self.config.keep_alive_timeout
                self._read_scope.deadline = self._linger_until
                with contextlib.suppress(trio.BrokenResourceError, trio.BusyResourceError,
                                         trio.ClosedResourceError):
                    await self.stream.send_eof()
        self._response_ended.set()  # nothing more is written
        if not self._read_ended.is_set():
            # the read loop lingers, and its end closes the socket (`run`); the application's task,
            # which asks for the close at the end of a last response, does not wait for it, so
            # that it counts the connection busy no longer (`Connections.serve`)
            return
        await self.stream.aclose()


async def terminate_when(wind_down: trio.Event, context: WorkerContext) -> None:
    """hypercorn's graceful shutdown of one connection once `wind_down` is set (its lifetime is
    over): closed at once when idle, or once the response in flight is sent."""
    await wind_down.wait()
    await context.terminated.set()


async def refuse_websocket(stream: trio.SocketStream, receive: Any) -> None:
    """We serve no websocket: its connection is closed unanswered, and the application returns
    only once hypercorn has seen the connection end. Answering (or returning, which hypercorn
    answers with a 500) raced hypercorn's own 400 to a client that sends bytes before its
    handshake is answered: each of the two tasks then found h11 in the state the other had left
    it in, and the LocalProtocolError ended the whole server (hypercorn issue #225)."""
    stream.socket.close()
    while (await receive())["type"] != "websocket.disconnect":
        pass


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


async def serve(app: WebApp, listen: str, field: str = "--listen", *, connections: Connections | None = None,
                task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on `listen` until cancelled, within `connections`' bounds (when None, the
    defaults with loopback trusted: `trusting`); `task_status.started("http://HOST:PORT")`."""
    connections = connections or Connections(trusting())
    sock = bind(listen, field)
    host, port = sock.getsockname()[:2]
    config = Config()
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # through our handlers and format (--log-format)
    config.keep_alive_timeout = connections.limits.idle_s  # until a whole request head, then between requests
    config.keep_alive_max_requests = KEEP_ALIVE_MAX_REQUESTS
    # one request at a time on a connection, as HTTP/1.1 has it: each HTTP/2 stream holds its response
    # until the client takes it, and hypercorn's 100 let 8 connections from one address hold 480 MB of
    # 1 MiB responses (no browser speaks HTTP/2 without TLS; more streams close the connection);
    # `ConnectionServer._go_away` counts on it to name the last stream the application saw
    config.h2_max_concurrent_streams = 1
    # read_timeout stays unset: while a request is served the client owes us nothing, and the
    # wait for the next one is keep_alive_timeout's
    url = f"http://{join_host_port(host, port)}"

    async def serve_one(stream: trio.SocketStream, wind_down: trio.Event, busy: Busy) -> None:
        async def answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "websocket":
                await refuse_websocket(stream, receive)
                return
            with busy():  # a connection between requests is the cheapest to evict
                await app(scope, receive, send)

        context = WorkerContext(None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(terminate_when, wind_down, context)
            await ConnectionServer(wrap_app(answer, config.wsgi_max_body_size, "asgi"), config, context, {}, stream)
            nursery.cancel_scope.cancel()

    with trio.socket.from_stdlib_socket(sock) as listener:
        log.info("serving %s", url)
        task_status.started(url)
        await connections.serve(listener, serve_one)


async def serve_peer_http(node: Any, listen: str,
                          task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """The running peer's server ([peer] metrics_listen): its metrics, health and dashboard, with
    a share of its connections kept for loopback and [peer] metrics_trusted_networks."""
    from p2pnet.dashboard import peer_snapshot
    from p2pnet.metrics import PeerCollector, render
    from prometheus_client import CollectorRegistry

    collector = PeerCollector(node)
    connections = Connections(trusting(node.config.metrics_trusted_networks))
    for warning in wide_network_warnings(node.config.metrics_trusted_networks):
        log.warning("%s", warning)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    registry.register(connections)

    app = WebApp(snapshot=peer_snapshot(node), metrics=lambda: render(registry), health=collector.health)
    await serve(app, listen, "peer.metrics_listen", connections=connections, task_status=task_status)

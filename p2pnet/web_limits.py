"""The bounds on what strangers may hold of the peer's HTTP server (`p2pnet.web`).

`[peer] metrics_listen` may face the internet (an operator scraping a peer from elsewhere), so
one stranger with a script must not exhaust the peer's file descriptors or memory, nor lock out
the operator's scraper, nor hold the peer's shutdown. `p2pnet.web` accepts connections through
`Connections.serve`, which bounds (`Limits`):

- the connections open at once, in all and per client (`client_key`: an IPv4 address, an IPv6
  /64). A connection over a cap is closed unanswered, counted (`p2pnet_http_connections_refused`,
  by cap) and named in a warning at most once a minute. `ConnectionGate` is that count, free
  of I/O;
- how long a connection may live (`lifetime_s`): it is then asked to close once the response
  in flight is sent (at once if none is), and reset `idle_s` later whatever it does. The reset
  ends a client that never reads its response (hypercorn shields its writes from cancellation,
  so such a client held its connection, and the peer's shutdown, for as long as it liked) and
  any other way of keeping a connection busy that hypercorn's idle timer does not see (an
  HTTP/2 client that sends the preface and opens no stream, for one: hypercorn stops the timer
  on the preface);
- and, applied by hypercorn as `p2pnet.web` configures it (the request to close included), how
  long a request may take to arrive whole after the connection opens or the previous response
  ends (`idle_s`: slow headers, idle keep-alive connections), and how many requests one
  connection may carry (`KEEP_ALIVE_MAX_REQUESTS`, so a polling client reconnects before
  `lifetime_s`).

This module knows nothing of HTTP: it owns accepting, counting and closing.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import ipaddress
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

import trio

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """How much of the server a client may hold (see the module docstring), and why these
    numbers. A Prometheus scraper holds one connection and a dashboard tab one to three, so 8 per
    client leaves room for a browser's six parallel connections to one host besides a scraper
    and a curl on the same machine. 64 in all is a small share of a peer's file descriptors and
    memory (hypercorn holds at most 16 KiB of an unfinished request and one 64 KiB read per
    connection) and still 8 clients at their cap. An honest client sends its request as soon as
    it connects: `idle_s` 5 s is ample over a slow link, and longer than the dashboard's 2 s poll,
    so an open tab keeps its connection; a scraper (every 15 s or more) reconnects each time,
    which it handles as a matter of course. `lifetime_s` 60 s is minutes more than any of our
    responses needs and bounds what a client that does not read can hold (for `idle_s` more: a
    response in flight at the lifetime has that long to finish before the reset). None of this
    is a setting: an operator behind a reverse proxy (one address for every viewer) would be
    the first to need one."""

    max_connections: int = 64
    max_per_ip: int = 8
    idle_s: float = 5.0
    lifetime_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.max_per_ip <= self.max_connections:
            raise ValueError(f"need 0 < max_per_ip <= max_connections, not {self.max_per_ip}, {self.max_connections}")
        if not 0 < self.idle_s < self.lifetime_s:
            raise ValueError(f"need 0 < idle_s < lifetime_s, not {self.idle_s}, {self.lifetime_s}")


# a keep-alive client is told to reconnect (Connection: close) after this many requests: the
# dashboard's 2 s poll does 20 in 40 s, before `lifetime_s` would close it
KEEP_ALIVE_MAX_REQUESTS = 20
REFUSAL_WARNING_S = 60.0  # at most one warning about refused connections per minute
# accept() failing for want of descriptors or memory: wait for connections to end (as trio does)
ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
ACCEPT_RETRY_S = 0.1
# accept() failing for one connection only (reset or refused by a firewall before we took it)
ACCEPT_IGNORED_ERRNOS = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}


class Refusal(enum.Enum):
    """Why a connection was closed unanswered (the label of the refused counter)."""

    TOTAL = "total"  # max_connections open in all
    PER_IP = "per_ip"  # max_per_ip open from its address


def client_key(host: str) -> str:
    """Whom a connection counts against: its IPv4 address (also when it arrives IPv4-mapped on
    a dual-stack socket), or the /64 of its IPv6 address, since one host is commonly handed a
    whole /64 and a per-address cap would not bound it."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class ConnectionGate:
    """The count of open connections, in all and by client key, against `Limits`: `admit`
    before serving one (None, or why not), `release` when it is closed. No clock, no I/O."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.open = 0
        self.by_key: dict[str, int] = {}
        self.refused = {refusal: 0 for refusal in Refusal}

    def admit(self, key: str) -> Refusal | None:
        refusal = None
        if self.open >= self.limits.max_connections:
            refusal = Refusal.TOTAL
        elif self.by_key.get(key, 0) >= self.limits.max_per_ip:
            refusal = Refusal.PER_IP
        if refusal is not None:
            self.refused[refusal] += 1
            return refusal
        self.open += 1
        self.by_key[key] = self.by_key.get(key, 0) + 1
        return None

    def release(self, key: str) -> None:
        left = self.by_key[key] - 1
        if left:
            self.by_key[key] = left
        else:
            del self.by_key[key]
        self.open -= 1


class Connections:
    """The trio side of the bounds: accepts, admits through a `ConnectionGate`, serves each
    admitted connection for at most `lifetime_s` (and `idle_s` to wind down); also the
    prometheus_client collector of its counts and what a test waits on (`wait_open`)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.gate = ConnectionGate(self.limits)
        self._changed = trio.Event()
        self._unwarned = 0
        self._quiet_until = float("-inf")

    async def wait_open(self, count: int) -> None:
        """Until exactly `count` connections are open."""
        while self.gate.open != count:
            await self._changed.wait()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        from p2pnet.metrics import gauge, labelled

        yield gauge("p2pnet_http_connections", "Connections open to this HTTP server.", self.gate.open)
        yield labelled(CounterMetricFamily("p2pnet_http_connections_refused", "Connections to this HTTP server "
                                           "closed unanswered, by the cap they met (total, per_ip).", labels=["cap"]),
                       {refusal.value: count for refusal, count in self.gate.refused.items()})

    async def serve(self, listener: trio.socket.SocketType,
                    serve_one: Callable[[trio.SocketStream, trio.Event], Awaitable[None]]) -> None:
        """Accept on `listener` until cancelled; `serve_one(stream, wind_down)` for each admitted
        connection, which should close it once the response in flight is sent when `wind_down`
        is set (at `lifetime_s`; it is reset `idle_s` later)."""
        async with trio.open_nursery() as nursery:
            while True:
                sock, key = await self._accept(listener)
                refusal = self.gate.admit(key)
                if refusal is not None:
                    sock.close()
                    self._warn(key, refusal)
                    continue
                self._notify()
                nursery.start_soon(self._connection, trio.SocketStream(sock), key, serve_one)

    async def _accept(self, listener: trio.socket.SocketType) -> tuple[trio.socket.SocketType, str]:
        while True:
            try:
                sock, address = await listener.accept()
            except OSError as exc:
                if exc.errno in ACCEPT_CAPACITY_ERRNOS:
                    log.error("cannot accept: %s; retrying in %s s", exc.strerror, ACCEPT_RETRY_S)
                    await trio.sleep(ACCEPT_RETRY_S)
                elif exc.errno not in ACCEPT_IGNORED_ERRNOS:
                    raise
                continue
            return sock, client_key(address[0])

    async def _connection(self, stream: trio.SocketStream, key: str,
                          serve_one: Callable[[trio.SocketStream, trio.Event], Awaitable[None]]) -> None:
        try:
            async with trio.open_nursery() as nursery:
                wind_down = trio.Event()
                nursery.start_soon(self._expire, stream, wind_down, nursery.cancel_scope)
                await serve_one(stream, wind_down)
                nursery.cancel_scope.cancel()
        finally:
            self.gate.release(key)
            self._notify()

    async def _expire(self, stream: trio.SocketStream, wind_down: trio.Event, scope: trio.CancelScope) -> None:
        """Set `wind_down` after `lifetime_s` (an honest client's response in flight is finished,
        not cut) and close `stream` `idle_s` later, or at once when the connection ends or the
        server stops. Cancelling is not enough: hypercorn shields its socket writes
        (tcp_server.py, protocol_send), so a client that does not read holds a write until the socket closes
        under it (the write then fails as if the client had gone)."""
        try:
            await trio.sleep(self.limits.lifetime_s)
            wind_down.set()
            await trio.sleep(self.limits.idle_s)
            with contextlib.suppress(OSError):  # a reset: the kernel keeps nothing the client would not take
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            stream.socket.close()
            scope.cancel()

    def _warn(self, key: str, refusal: Refusal) -> None:
        self._unwarned += 1
        now = trio.current_time()
        if now < self._quiet_until:
            return
        cap = (f"{self.limits.max_connections} open in all" if refusal is Refusal.TOTAL
               else f"{self.limits.max_per_ip} open from it")
        log.warning("refused an HTTP connection from %s (%s); %d refused since the last such warning",
                    key, cap, self._unwarned)
        self._unwarned = 0
        self._quiet_until = now + REFUSAL_WARNING_S

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

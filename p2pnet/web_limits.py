"""The bounds on what strangers may hold of the peer's HTTP server (`p2pnet.web`).

`[peer] metrics_listen` may face the internet (an operator scraping a peer from elsewhere), so
one stranger with a script must not exhaust the peer's file descriptors or memory, nor lock out
the operator's scraper, nor hold the peer's shutdown. `p2pnet.web` accepts connections through
`Connections.serve`, which bounds (`Limits`):

- the connections open at once, in all and per client (`client_key`: an IPv4 address, an IPv6
  /64 or the trusted network narrower than it that holds the address). A client at its own cap
  is refused (closed unanswered), whether the server is full or not. A full server is shared
  fairly rather than first come, first served, between networks first (`network_key`: an IPv4
  /24, an IPv6 /48), then between the clients of one network: a newcomer whose network, counting
  it, would still hold fewer connections than the network holding the most takes a slot from
  that network (one of its connections is reset at once); failing that, a newcomer whose client
  would still hold fewer than the client of its own network holding the most takes a slot from
  that client; any other newcomer is refused. So attackers from a few addresses, or from the
  many /64s of one customer's /56, cannot fill the server and lock the operator's scraper out:
  while any network holds 2 or more, a scraper from a network holding none gets in, and one from
  the attacker's own network gets in while any client there holds 2 or more. Why /24 and /48: a
  customer of a hosting provider or an ISP is commonly handed that much or less, so a network is
  one owner more often than a client is; an honest NAT stays one client of its network. The
  price is paid by honest clients sharing a network with an attacker: a scraper on the
  attacker's /24 (a cloud provider's range) competes only within it, as every client competed
  before networks were counted. Fair sharing alone leaves the server to an attacker with
  addresses in more networks than it has slots, each holding one (it reconnects as the lifetime
  below ends each), and the operator's own scraper and health checks with it. So the operator's
  networks (`trusted_networks`: loopback always, and `[peer] metrics_trusted_networks`) have a
  share strangers cannot take: strangers hold at most `max_connections - trusted_reserve`, while
  the operator's clients may take any slot and are shared fairly among themselves as strangers
  are; neither kind ever takes a slot of the other's. The operator's scraper is then locked out
  only by the operator's own clients; a stranger's scraper still is by an attacker in
  `max_connections - trusted_reserve` networks or more, which is bounded by how many networks it
  has, not by how fast it reconnects. A trusted network wider than any one operator's
  (`too_wide`: shorter than an IPv4 /8 or an IPv6 /16; 0.0.0.0/0 or ::/0 trusts everyone) gives
  strangers in it the reserve too: it is kept, as it may be meant, and the peer warns at start
  and in its status. A connection is trusted by the address it connected from, which TCP's
  handshake makes a stranger off its path unable to forge; nothing but the share is granted by it
  (the per-client cap and the deadlines apply as to anyone). A forwarder on the peer's own machine
  (a reverse proxy, an SSH tunnel, an onion service) makes its clients loopback, so the
  operator's: as one address they hold at most `max_per_ip`, and a scraper from another trusted
  network still takes a slot from them. Refusals and evictions are counted
  (`p2pnet_http_connections_refused` by cap, `p2pnet_http_connections_evicted`) and named in a
  warning at most once a minute, and the trusted connections open are shown
  (`p2pnet_http_connections_trusted`). `ConnectionGate` is that count, and chooses whom to
  evict, free of I/O;
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
  `lifetime_s`), and how long a connection that has sent its end of stream waits for the
  client's (`idle_s`: closing with the client's bytes unread would reset it, and drop the tail
  of the last response).

Whom to evict, in the networks chosen: of the connections of their clients holding the most, an
idle one (before its first whole request or between two: its client loses only the connection,
which an honest keep-alive client reopens as a matter of course, where a busy one would lose a
response half sent), and of those the oldest (admitted first: nearest its lifetime's end
anyway, and a connection held longest is the likeliest to be held rather than used).
`p2pnet.web` says when a connection is busy (`Connections.serve`'s `busy`: while the
application answers one of its requests).

What a client sends must never stop the server (and with it the peer): an error raised while
serving one connection ends that connection only, logged with its traceback as the bug it is (of
ours or hypercorn's; one a minute, the rest counted in the next) and counted
(`p2pnet_http_connections_failed`).

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
from collections import Counter
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, Awaitable, Callable, ContextManager, Iterator

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
    response in flight at the lifetime has that long to finish before the reset). Of these only
    the trusted networks are a setting: an operator behind a reverse proxy (one address for every
    viewer) would be the first to need more. When the server is full a newcomer takes a slot from
    the network holding the most, while its own would still hold fewer, else from the client of
    its own network holding the most, while its client would still hold fewer (the module
    docstring): a stranger's scraper gets in unless `max_connections - trusted_reserve` networks
    or more hold one each. The operator's own (`trusted_networks`: the peer's server trusts
    loopback and `[peer] metrics_trusted_networks`, `trusting`) get in whatever strangers hold,
    since strangers hold at most `max_connections - trusted_reserve`: 8 is a scraper's, a health
    check's and a dashboard tab's connections at once, and leaves strangers 56, still 7 clients at
    their cap. With no trusted network nothing is reserved."""

    max_connections: int = 64
    max_per_ip: int = 8
    idle_s: float = 5.0
    lifetime_s: float = 60.0
    trusted_networks: tuple[str, ...] = ()  # IPv4 or IPv6 networks (192.0.2.0/24): the operator's clients
    trusted_reserve: int = 8  # of max_connections, what strangers cannot take (with a trusted network)

    def __post_init__(self) -> None:
        if not 0 < self.max_per_ip <= self.max_connections:
            raise ValueError(f"need 0 < max_per_ip <= max_connections, not {self.max_per_ip}, {self.max_connections}")
        if not 0 < self.idle_s < self.lifetime_s:
            raise ValueError(f"need 0 < idle_s < lifetime_s, not {self.idle_s}, {self.lifetime_s}")
        if self.trusted_networks and not 0 < self.trusted_reserve < self.max_connections:
            raise ValueError(f"need 0 < trusted_reserve < max_connections, not {self.trusted_reserve}, "
                             f"{self.max_connections}")
        for network in self.trusted_networks:
            trusted_network(network)  # ValueError naming it

    @cached_property
    def _networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """`trusted_networks` read (`trusted_network`), once, not at each connection."""
        return tuple(trusted_network(network) for network in self.trusted_networks)

    def _holding(self, host: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """The trusted networks a client at `host` (as the socket gave it) is in."""
        address = _address(host)
        return [network for network in self._networks if address in network]

    def trusts(self, host: str) -> bool:
        """Whether a client at `host` (as the socket gave it) is in one of `trusted_networks`."""
        return bool(self._holding(host))

    def counted_as(self, host: str) -> tuple[str, str, bool]:
        """What a client at `host` (as the socket gave it) counts against: its client and network
        (`client_key`, given the narrowest trusted network holding it, `network_key`) and whether
        it is of a trusted network."""
        prefixes = [network.prefixlen for network in self._holding(host)]
        return client_key(host, max(prefixes, default=0)), network_key(host), bool(prefixes)

    def share(self, trusted: bool) -> int:
        """How many connections the trusted networks' clients, or strangers, may hold in all: a
        stranger never takes the last `trusted_reserve`, a trusted client may take any slot."""
        return self.max_connections - (self.trusted_reserve if self.trusted_networks and not trusted else 0)


LOOPBACK = ("127.0.0.0/8", "::1/128")


# The widest trusted network taken without a warning: an IPv4 /8 (10.0.0.0/8, the widest private
# range, or a legacy block of one owner) and an IPv6 /16 (wider than any one holder's allocation,
# the widest of which are about /19; fd00::/8 is every site's private /48s at once). A wider one
# is almost surely a mistake, or 0.0.0.0/0 or ::/0 meant as "trust everyone": either way strangers
# in it are trusted and share the reserve, which is then no reserve against them.
WIDE_PREFIX = {4: 8, 6: 16}


def too_wide(networks: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `networks` (as written, each valid: `trusted_network`) wider than `WIDE_PREFIX`:
    the peer warns about them (`wide_network_warnings`) and keeps them, since trusting everyone
    may be meant (a peer no stranger can reach)."""
    wide = []
    for text in networks:
        network = trusted_network(text)
        if network.prefixlen < WIDE_PREFIX[network.version]:
            wide.append(text)
    return tuple(wide)


def wide_network_warnings(networks: tuple[str, ...]) -> list[str]:
    """What the peer says of each of `networks` ([peer] metrics_trusted_networks) that is
    `too_wide`: logged when its server starts (`p2pnet.web.serve_peer_http`) and shown by
    `p2pnet peer status` while it runs."""
    reserve = trusting(networks).trusted_reserve
    return [f"[peer] metrics_trusted_networks {network} is wider than any one operator's network (an IPv4 /8, "
            f"an IPv6 /16): every client in it is trusted, so strangers there may take the {reserve} connections "
            "of metrics_listen kept for the operator's scrapers and health checks; write the operator's own "
            "networks instead, unless trusting all of it is meant" for network in too_wide(networks)]


def trusting(networks: tuple[str, ...] = ()) -> Limits:
    """The bounds of the peer's server and of `p2pnet dashboard`'s (`p2pnet.web.serve`):
    `networks` trusted, and loopback always (a client on the peer's own machine has the
    operator's privileges anyway)."""
    return Limits(trusted_networks=LOOPBACK + networks)


# a keep-alive client is told to reconnect (Connection: close) after this many requests: the
# dashboard's 2 s poll does 20 in 40 s, before `lifetime_s` would close it
KEEP_ALIVE_MAX_REQUESTS = 20
REFUSAL_WARNING_S = 60.0  # at most one warning a minute about connections refused or evicted, one error about failed ones
# accept() failing for want of descriptors or memory: wait for connections to end (as trio does)
ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
ACCEPT_RETRY_S = 0.1
# accept() failing for one connection only: reset or refused by a firewall before we took it, or
# (accept(2) on Linux) the new connection's pending network error, which a client or its route
# can cause at will; the set trio's SocketListener ignores, since any other ends the server
ACCEPT_IGNORED_ERRNOS = {getattr(errno, name) for name in (
    "ECONNABORTED", "EPROTO", "EPERM", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET", "EHOSTUNREACH",
    "EOPNOTSUPP", "ENETUNREACH", "ENOSR", "ESOCKTNOSUPPORT", "EPROTONOSUPPORT", "ETIMEDOUT", "ECONNRESET")
    if hasattr(errno, name)}


class Refusal(enum.Enum):
    """Why a connection was closed unanswered (the label of the refused counter)."""

    # its kind's share open (`Limits.share`: max_connections in all, or fewer to strangers), and its
    # network or client would hold as many as the most-holding one
    TOTAL = "total"
    PER_IP = "per_ip"  # max_per_ip open from its client (`client_key`), whether the server is full or not


@dataclass(frozen=True)
class Admitted:
    """A newcomer admitted as `connection`; when the server was full it takes the slot of
    `evicted`, which the shell must close at once (its key is in `ConnectionGate.closing`)."""

    connection: int
    evicted: int | None = None


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A peer's address as the socket gave it (a scope id dropped), IPv4 also when it arrives
    IPv4-mapped on a dual-stack socket."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def trusted_network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """One of `Limits.trusted_networks` as the operator wrote it (192.0.2.0/24, 2001:db8::/48, or
    one address), read as a client's address is (`_address`): an IPv4-mapped network is the IPv4
    network it maps, since a client arriving mapped on a dual-stack socket is matched as IPv4. A
    network with host bits set (192.0.2.7/24) is refused, not masked: it is as likely a prefix
    mistyped, and a prefix too short trusts strangers. ValueError names the text and what was
    meant."""
    try:
        network = ipaddress.ip_network(text)
    except ValueError as exc:
        try:
            masked = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ValueError(f"{text!r} is not an IP network such as 192.0.2.0/24 or 2001:db8::/48 "
                             "(or one address)") from exc
        raise ValueError(f"{text!r} has host bits set: write the network {masked} or the one address "
                         f"{text.split('/', 1)[0]}") from exc
    mapped = network.network_address.ipv4_mapped if isinstance(network, ipaddress.IPv6Network) else None
    if mapped is not None and network.prefixlen >= 96:
        return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
    return network


def network_key(host: str) -> str:
    """The network a client belongs to, which shares the server first (`ConnectionGate`): the
    /24 of an IPv4 address, the /48 of an IPv6 one (a site's usual allocation; a customer handed
    a /56 has 256 /64s, each a client, all in one /48)."""
    address = _address(host)
    prefix = 24 if isinstance(address, ipaddress.IPv4Address) else 48
    return str(ipaddress.ip_network((address, prefix), strict=False))


def client_key(host: str, trusted_prefix: int = 0) -> str:
    """Whom a connection counts against: its IPv4 address (also when it arrives IPv4-mapped on
    a dual-stack socket), or the /64 of its IPv6 address, since one host is commonly handed a
    whole /64 and a per-address cap would not bound it; but the trusted network it is in when
    that is narrower (`trusted_prefix`, its prefix length: one address written alone counts as
    itself). The operator may trust a few addresses of a /64 whose others are strangers', who
    must not use up their cap; a network written as wide as a /64 or wider (a /48, ::/0) trusts
    no address on its own, so a host there still counts as its /64, as a stranger's does."""
    address = _address(host)
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, max(64, trusted_prefix)), strict=False))
    return str(address)


@dataclass
class Held:
    """One admitted connection: whom it counts against (its client and the client's network),
    whether that is a trusted one (`Limits.trusted_networks`), and how many of its requests the
    application is answering (0: idle)."""

    key: str
    network: str
    trusted: bool = False
    busy: int = 0


class ConnectionGate:
    """The count of open connections, in all, by client, by network and from trusted networks,
    against `Limits`: `admit` before serving one (an `Admitted`, which may name a connection to
    evict, or a `Refusal`); `started` and `ended` around each request it carries; `release` once
    it is closed. Connections are numbered in the order admitted, so the lowest number is the
    oldest. An evicted connection leaves the count at once (its slot is the newcomer's) and waits
    in `closing` for its `release`, so that each slot is freed exactly once. Trusted clients and
    strangers are two kinds that never take each other's slots: each kind is full at its share
    (`Limits.share`), or when the server is, and is then shared fairly within itself. No clock,
    no I/O."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.held: dict[int, Held] = {}  # in the order admitted
        self.by_key: dict[str, int] = {}
        self.by_network: dict[str, int] = {}
        self.trusted = 0  # of `open`, from trusted networks
        self.closing: dict[int, str] = {}  # evicted, not yet released: their keys
        self.refused = {refusal: 0 for refusal in Refusal}
        self.evicted = 0
        self._next = 0

    @property
    def open(self) -> int:
        return len(self.held)

    def admit(self, key: str, network: str | None = None, trusted: bool = False) -> Admitted | Refusal:
        """A newcomer from client `key`, in `network` (`network_key`; its own when None), of a
        trusted network or not (`Limits.trusts`)."""
        network = key if network is None else network
        count = self.by_key.get(key, 0)
        evicted = None
        of_its_kind = self.trusted if trusted else self.open - self.trusted
        if count >= self.limits.max_per_ip:
            # at its cap, full server or not (none is taken from another for it: between networks
            # no client's count is compared)
            return self._refuse(Refusal.PER_IP)
        if self.open >= self.limits.max_connections or of_its_kind >= self.limits.share(trusted):
            evicted = self._victim(key, network, trusted)
            if evicted is None:
                return self._refuse(Refusal.TOTAL)
            self._drop(evicted)
            self.closing[evicted] = self.held.pop(evicted).key
            self.evicted += 1
        self._next += 1
        self.held[self._next] = Held(key, network, trusted)
        self.trusted += trusted
        self.by_key[key] = count + 1
        self.by_network[network] = self.by_network.get(network, 0) + 1
        return Admitted(self._next, evicted)

    def started(self, connection: int) -> None:
        """The application is answering a request of `connection` (ignored once it is evicted)."""
        if connection not in self.closing:
            self.held[connection].busy += 1

    def ended(self, connection: int) -> None:
        if connection not in self.closing:
            self.held[connection].busy -= 1

    def key_of(self, connection: int) -> str:
        """Whom `connection` counts against (counted, once it is evicted)."""
        return self.closing[connection] if connection in self.closing else self.held[connection].key

    def release(self, connection: int) -> None:
        """`connection` is closed: its slot is free (it was already, when it was evicted). A
        connection released twice is our bug: KeyError."""
        if self.closing.pop(connection, None) is not None:
            return
        self._drop(connection)
        del self.held[connection]

    def _victim(self, key: str, network: str, trusted: bool) -> int | None:
        """The connection a newcomer from client `key` in `network` takes the slot of, among the
        connections of its kind (trusted or not, counted apart: a trusted client may share a
        network with strangers), shared first between networks, then between the clients of the
        newcomer's network: one of the networks holding the most, when the newcomer's, counting
        it, would still hold fewer; else one of the clients of its own network holding the most
        within it, when its client would still hold fewer; else None (a swap that only traded one
        network's or client's connection for another's would gain nothing, and among equals it
        would go on for ever). Among those, the connections of the clients holding the most, idle
        before busy, then the oldest."""
        kind = {c: held for c, held in self.held.items() if held.trusted == trusted}
        by_network = Counter(held.network for held in kind.values())
        by_key = Counter(held.key for held in kind.values())
        most = max(by_network.values(), default=0)
        between_networks = by_network[network] + 1 < most
        candidates = [c for c, held in kind.items()
                      if (by_network[held.network] == most if between_networks else held.network == network)]
        most_of_client = max((by_key[kind[c].key] for c in candidates), default=0)
        if not between_networks and by_key[key] + 1 >= most_of_client:
            return None
        return min((c for c in candidates if by_key[kind[c].key] == most_of_client),
                   key=lambda connection: (kind[connection].busy > 0, connection))

    def _drop(self, connection: int) -> None:
        held = self.held[connection]
        self.trusted -= held.trusted
        for counts, key in ((self.by_key, held.key), (self.by_network, held.network)):
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]

    def _refuse(self, refusal: Refusal) -> Refusal:
        self.refused[refusal] += 1
        return refusal


class OncePer:
    """At most once per `interval_s`: `due(now)` is True for the first call and then for the first
    one `interval_s` or more after the last True (a log a client's behaviour can repeat at will)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._next = float("-inf")

    def due(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True


Busy = Callable[[], ContextManager[None]]  # held around each request the application answers


class Connections:
    """The trio side of the bounds: accepts, admits through a `ConnectionGate`, serves each
    admitted connection for at most `lifetime_s` (and `idle_s` to wind down), resets the ones
    the gate evicts; also the prometheus_client collector of its counts and what a test waits
    on (`wait_open`)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.gate = ConnectionGate(self.limits)
        self._live: dict[int, tuple[trio.SocketStream, trio.CancelScope]] = {}  # by the gate's number
        self.failed = 0  # connections whose serving raised (`_connection`)
        self._failures_logged = 0  # `failed` at the last one logged
        self._failure_log = OncePer(REFUSAL_WARNING_S)
        self._changed = trio.Event()
        self._warned = (0, 0)  # refused and evicted in all at the last warning
        self._warning_log = OncePer(REFUSAL_WARNING_S)

    async def wait_open(self, count: int) -> None:
        """Until exactly `count` connections are open and none evicted is still ending."""
        while self.gate.open != count or self.gate.closing:
            await self._changed.wait()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        from p2pnet.metrics import counter, gauge, labelled

        yield gauge("p2pnet_http_connections", "Connections open to this HTTP server.", self.gate.open)
        yield gauge("p2pnet_http_connections_trusted", "Connections open to this HTTP server from its trusted "
                    "networks (loopback, [peer] metrics_trusted_networks), whose share strangers cannot take.",
                    self.gate.trusted)
        yield labelled(CounterMetricFamily("p2pnet_http_connections_refused", "Connections to this HTTP server "
                                           "closed unanswered, by the cap they met (total, per_ip).", labels=["cap"]),
                       {refusal.value: count for refusal, count in self.gate.refused.items()})
        yield counter("p2pnet_http_connections_evicted", "Connections to this HTTP server reset when it was full, "
                      "each to admit one from a client holding fewer than the client it was taken from.",
                      self.gate.evicted)
        yield counter("p2pnet_http_connections_failed", "Connections to this HTTP server whose serving raised an "
                      "unexpected error (a bug of p2pnet's or hypercorn's, logged): each closed, the server going on.",
                      self.failed)

    async def serve(self, listener: trio.socket.SocketType,
                    serve_one: Callable[[trio.SocketStream, trio.Event, Busy], Awaitable[None]]) -> None:
        """Accept on `listener` until cancelled; `serve_one(stream, wind_down, busy)` for each
        admitted connection, which should close it once the response in flight is sent when
        `wind_down` is set (at `lifetime_s`; it is reset `idle_s` later), and hold `busy()`
        while its application answers a request (an idle connection is evicted first)."""
        async with trio.open_nursery() as nursery:
            while True:
                sock, host = await self._accept(listener)
                key, network, trusted = self.limits.counted_as(host)
                verdict = self.gate.admit(key, network, trusted)
                if isinstance(verdict, Refusal):
                    sock.close()
                    cap = (self._full(trusted) if verdict is Refusal.TOTAL
                           else f"{self.limits.max_per_ip} open from it")
                    self._warn("refused an HTTP connection from %s (%s)", key, cap)
                    continue
                if verdict.evicted is not None:
                    self._evict(verdict.evicted, key, trusted)
                self._live[verdict.connection] = (trio.SocketStream(sock), trio.CancelScope())
                self._notify()
                nursery.start_soon(self._connection, verdict.connection, serve_one)

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
            return sock, address[0]

    async def _connection(self, connection: int,
                          serve_one: Callable[[trio.SocketStream, trio.Event, Busy], Awaitable[None]]) -> None:
        stream, scope = self._live[connection]
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    wind_down = trio.Event()
                    nursery.start_soon(self._expire, stream, wind_down, scope)
                    await serve_one(stream, wind_down, partial(self._busy, connection))
                    scope.cancel()
        except* Exception as failure:
            # whatever a client sends is handled by hypercorn and the application, so this is a bug
            # of ours or hypercorn's, met by one connection: it ends that connection (its socket is
            # closed by `_expire`), not the server and with it the peer, and is not lost (the
            # cancellation of a stopping server, a BaseException, goes on up)
            # (one traceback a minute: a client able to meet such a bug at will must not fill the log)
            self.failed += 1
            if self._failure_log.due(trio.current_time()):
                log.error("serving an HTTP connection from %s failed, a bug in p2pnet.web or hypercorn; "
                          "the connection is closed and the server goes on (%d more failed since the last such "
                          "error, not logged: one a minute)", self.gate.key_of(connection),
                          self.failed - self._failures_logged - 1, exc_info=failure)
                self._failures_logged = self.failed
        finally:
            del self._live[connection]
            self.gate.release(connection)
            self._notify()

    async def _expire(self, stream: trio.SocketStream, wind_down: trio.Event, scope: trio.CancelScope) -> None:
        """Set `wind_down` after `lifetime_s` (an honest client's response in flight is finished,
        not cut) and reset `stream` `idle_s` later, or close it at once when the connection ends,
        is evicted or the server stops. Cancelling is not enough: hypercorn shields its socket
        writes (tcp_server.py, protocol_send), so a client that does not read holds a write until
        the socket closes under it (the write then fails as if the client had gone)."""
        try:
            await trio.sleep(self.limits.lifetime_s)
            wind_down.set()
            await trio.sleep(self.limits.idle_s)
            reset(stream.socket)
        finally:
            stream.socket.close()
            scope.cancel()

    def _evict(self, connection: int, newcomer: str, trusted: bool) -> None:
        """Reset `connection`, whose slot the gate gave a newcomer from `newcomer` (of a trusted
        network or not, as the evicted is), and end its serving at once; its own task releases it
        (the gate keeps it in `closing` until then, also when it was ending on its own at this
        moment)."""
        stream, scope = self._live[connection]
        reset(stream.socket)
        scope.cancel()
        key = self.gate.closing[connection]
        self._warn("closed an HTTP connection of %s (%d open from it, its network or it holding the most) to admit "
                   "one from %s (%s)", key, self.gate.by_key.get(key, 0) + 1, newcomer, self._full(trusted))

    def _full(self, trusted: bool) -> str:
        """What was full for a newcomer, trusted or not (`Limits.share`)."""
        share, most = self.limits.share(trusted), self.limits.max_connections
        if share == most:
            return f"{most} open in all"
        return f"{most} open in all or {share} from untrusted networks, the other {most - share} kept for trusted ones"

    @contextlib.contextmanager
    def _busy(self, connection: int) -> Iterator[None]:
        self.gate.started(connection)
        try:
            yield
        finally:
            self.gate.ended(connection)

    def _warn(self, message: str, *args: object) -> None:
        if not self._warning_log.due(trio.current_time()):
            return
        refused, evicted = sum(self.gate.refused.values()), self.gate.evicted
        log.warning(message + "; since the last such warning, %d refused and %d closed to admit others",
                    *args, refused - self._warned[0], evicted - self._warned[1])
        self._warned = (refused, evicted)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


def reset(sock: trio.socket.SocketType) -> None:
    """Close `sock` with a reset: the kernel then keeps nothing the client would not take (a
    plain close goes on trying to deliver what is unsent)."""
    with contextlib.suppress(OSError):  # closed already
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()

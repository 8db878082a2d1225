"""Strangers who open connections to the peer's HTTP server and hold them (`p2pnet.web_limits`,
`p2pnet.web`): real sockets on loopback against the real server. Connections over the per-client
and total caps are closed unanswered and counted while an honest scrape is still served; a
request that never arrives whole (sent in part, or dribbled a byte at a time: the one sleep here
is that client's pace), an idle keep-alive connection and a client that never reads its response
are closed by their deadlines (short ones, injected: each wait is that deadline plus `SLACK_S`);
a client that never reads does not hold the server's shutdown; a client that leaves is forgotten
at once, and a polling one is asked to reconnect before the lifetime would cut it; the server's
own count of open connections returns to 0. A full server takes a slot from the network holding
the most for a newcomer from one holding fewer, else from the client of the newcomer's network
holding the most for a newcomer from one holding fewer (an idle connection first; one inside a
write to a client that does not read is reset at once), and refuses a newcomer when that would
gain nothing. A pipelining client gets every response it is promised whole, also when it sends
more past them (the server lingers rather than reset them away). A request with a body no route
takes is answered at once and its connection ended, not held until the lifetime.
A client that breaks HTTP's framing (more requests after one that asked to close, bytes before a
websocket handshake is answered) gets no traceback into our logs and does not stop the server,
nor does a bug met while serving one connection (it ends that connection, logged and counted),
nor a network error that accept() passes on. Loopback gives each test several client addresses
(127.0.0.1, 127.0.0.2, ...: all of 127/8 is local on Linux), and several networks (127.0.1.1)."""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import logging
import os
import re
import socket
import tomllib
from functools import partial
from pathlib import Path
from typing import Awaitable, Callable

import h11
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
import trio
from hypercorn.protocol.events import Body
from hypercorn.protocol.http_stream import HTTPStream
from packaging.requirements import Requirement
from packaging.version import Version
from prometheus_client import CollectorRegistry, generate_latest

import p2pnet
from p2pnet.web import WebApp, serve
from p2pnet.web_limits import (KEEP_ALIVE_MAX_REQUESTS, Admitted, ConnectionGate, Connections, Limits, Refusal,
                               client_key, network_key, reset)

SLACK_S = 10.0  # less than the 30 s keep-alive hypercorn was given before these bounds
METRICS = b"p2pnet_up 1\n"
SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
KEEP_ALIVE = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
HOLD = dict(idle_s=300.0, lifetime_s=600.0)  # deadlines no test waits for


async def start(nursery: trio.Nursery, limits: Limits, metrics: bytes = METRICS,
                snapshot: Callable[[], Awaitable[dict]] | None = None) -> tuple[Connections, int]:
    async def empty() -> dict:
        return {}

    snapshot = snapshot or empty
    connections = Connections(limits)
    app = WebApp(snapshot=snapshot, metrics=lambda: metrics, health=lambda: None)
    url = await nursery.start(partial(serve, app, "127.0.0.1:0", connections=connections))
    return connections, int(url.rsplit(":", 1)[1])


async def connect(port: int, source: str = "127.0.0.1", receive_buffer: int | None = None) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    if receive_buffer is not None:  # a small window: the server's writes stall as soon as we stop reading
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    return sock


async def read_until_closed(sock: trio.socket.SocketType, within_s: float) -> bytes:
    """Everything the server sends until it closes the connection, which it must within `within_s`."""
    out = bytearray()
    with trio.fail_after(within_s):
        try:
            while data := await sock.recv(1 << 16):
                out += data
        except ConnectionResetError:
            pass
    return bytes(out)


async def scrape(port: int, source: str) -> bytes:
    with await connect(port, source) as sock:
        await sock.send(SCRAPE)
        return await read_until_closed(sock, SLACK_S)


async def settle(connections: Connections, count: int) -> None:
    """Until the server's own count of open connections is `count` (within SLACK_S)."""
    with trio.fail_after(SLACK_S):
        await connections.wait_open(count)


async def close_all(connections: Connections, held: list[trio.socket.SocketType]) -> None:
    """Close `held`; the server forgets them all, and every client with them."""
    for sock in held:
        sock.close()
    await settle(connections, 0)
    assert connections.gate.by_key == {}


async def unanswered(port: int, source: str) -> bytes:
    """What a scrape from `source` gets when the server closes it at once: nothing."""
    with await connect(port, source) as over:
        await over.send(SCRAPE)
        return await read_until_closed(over, SLACK_S)


async def stop_reading_mid_response(port: int, request: bytes = KEEP_ALIVE) -> trio.socket.SocketType:
    """A client that asks for a large response, reads its first 64 KiB and no more: the server
    is then inside its write of the rest, which cannot fit in the sockets' buffers."""
    reader = await connect(port, receive_buffer=4096)
    await reader.send(request)
    got = 0
    with trio.fail_after(SLACK_S):
        while got < 1 << 16:
            got += len(await reader.recv(1 << 16))
    return reader


async def read_response(sock: trio.socket.SocketType) -> bytes:
    """One response to a small request on a kept-alive connection (its body is METRICS)."""
    out = b""
    with trio.fail_after(SLACK_S):
        while not out.endswith(METRICS):
            data = await sock.recv(1 << 16)
            assert data, out
            out += data
    return out


def test_client_keys_and_the_gate_count():
    assert client_key("192.0.2.7") == client_key("::ffff:192.0.2.7") == "192.0.2.7"  # dual-stack socket
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff%eth0") == "2001:db8::/64"  # one host's /64
    assert client_key("2001:db8:0:1::1") != client_key("2001:db8::1")
    assert client_key("2001:db8::1", trusted_prefix=128) == "2001:db8::1/128"  # one address the operator trusts
    assert client_key("2001:db8::1", trusted_prefix=120) == "2001:db8::/120"
    assert client_key("2001:db8::1", trusted_prefix=48) == "2001:db8::/64"  # wider: a host's /64 still
    gate = ConnectionGate(Limits(max_connections=3, max_per_ip=2))
    a1, a2 = gate.admit("a"), gate.admit("a")
    assert isinstance(a1, Admitted) and isinstance(a2, Admitted) and gate.admit("a") is Refusal.PER_IP
    b1 = gate.admit("b")
    assert isinstance(b1, Admitted) and gate.admit("b") is Refusal.TOTAL  # b would hold as many as a
    gate.release(a1.connection)
    c1 = gate.admit("c")
    assert isinstance(c1, Admitted) and c1.evicted is None
    for admitted in (a2, b1, c1):
        gate.release(admitted.connection)
    assert (gate.open, gate.by_key, gate.refused) == (0, {}, {Refusal.TOTAL: 1, Refusal.PER_IP: 1})
    with pytest.raises(ValueError):
        Limits(max_connections=2, max_per_ip=3)
    with pytest.raises(ValueError):
        Limits(idle_s=10, lifetime_s=5)


def admit(gate: ConnectionGate, key: str) -> Admitted:
    admitted = gate.admit(key)
    assert isinstance(admitted, Admitted), admitted
    return admitted


def test_a_full_gate_gives_a_newcomer_the_slot_of_an_idle_connection_of_the_client_holding_the_most():
    gate = ConnectionGate(Limits(max_connections=4, max_per_ip=3))
    a1, a2, a3, b1 = (admit(gate, key).connection for key in "aaab")
    gate.started(a1)  # answering a request: kept while an idle one is left
    assert admit(gate, "c") == Admitted(5, evicted=a2)  # a holds the most: its oldest idle one
    assert (gate.by_key, gate.closing, gate.open, gate.evicted) == ({"a": 2, "b": 1, "c": 1}, {a2: "a"}, 4, 1)
    gate.started(a2)  # a request the evicted connection had begun: no longer counted
    assert admit(gate, "d") == Admitted(6, evicted=a3)  # a still holds the most (2)
    assert gate.admit("e") is Refusal.TOTAL  # all hold one: a swap would only trade one for another
    assert gate.admit("a") is Refusal.TOTAL  # a holds as many as the most
    assert gate.refused == {Refusal.TOTAL: 2, Refusal.PER_IP: 0}

    gate.release(a2)  # the evicted connection ends: its slot was freed when it was taken
    assert (gate.open, gate.closing, gate.by_key) == (4, {a3: "a"}, {"a": 1, "b": 1, "c": 1, "d": 1})
    with pytest.raises(KeyError):
        gate.release(a2)  # freed once only
    gate.ended(a1)
    for connection in (a3, a1, b1, 5, 6):
        gate.release(connection)
    assert (gate.open, gate.by_key, gate.closing) == (0, {}, {})


def test_the_gate_evicts_among_clients_tied_at_the_most_idle_first_then_oldest_within_the_per_client_cap():
    gate = ConnectionGate(Limits(max_connections=4, max_per_ip=2))
    a1, b1, b2, a2 = (admit(gate, key).connection for key in "abba")
    assert gate.admit("a") is Refusal.PER_IP  # at its own cap, full server or not
    gate.started(a1)
    gate.started(b1)
    assert admit(gate, "c").evicted == b2  # a and b tie at 2: the oldest idle one of either
    assert admit(gate, "d").evicted == a2  # now a alone holds 2: its idle one, not its older busy one
    gate = ConnectionGate(Limits(max_connections=3, max_per_ip=3))
    a1, a2, a3 = (admit(gate, "a").connection for _ in range(3))
    for connection in (a1, a2, a3):
        gate.started(connection)
    assert admit(gate, "b").evicted == a1  # all busy: the oldest
    gate.release(a2)  # one ends on its own just before the next newcomer: a free slot, nobody evicted
    assert admit(gate, "c").evicted is None
    assert gate.admit("d") is Refusal.TOTAL


def test_network_keys():
    assert network_key("192.0.2.7") == network_key("::ffff:192.0.2.200") == "192.0.2.0/24"
    assert network_key("2001:db8:0:ff::1") == network_key("2001:db8::1%eth0") == "2001:db8::/48"  # a /56's 256 /64s
    assert network_key("2001:db8:1::1") != network_key("2001:db8::1")


def test_a_full_gate_is_shared_between_networks_first_then_between_the_clients_of_one():
    """One customer's /56 is 256 clients (/64s) of one network: holding one connection each, they
    no longer fill the server against other networks, and within their network the clients share
    as clients did before."""
    gate = ConnectionGate(Limits(max_connections=4, max_per_ip=4))
    n1, n2, n3, n4 = (gate.admit(f"n{i}", "N") for i in range(1, 5))
    assert isinstance(n1, Admitted) and isinstance(n2, Admitted)
    gate.started(n1.connection)
    assert gate.admit("m1", "M") == Admitted(5, evicted=n2.connection)  # N holds the most: its oldest idle one
    assert gate.admit("m2", "M") == Admitted(6, evicted=n3.connection)  # N still holds the most (3)
    assert gate.admit("n5", "N") is Refusal.TOTAL  # N and M hold 2 each; in N every client holds one
    assert gate.admit("m3", "M") is Refusal.TOTAL  # M would hold as many as the most
    assert gate.by_network == {"N": 2, "M": 2}
    gate = ConnectionGate(Limits(max_connections=4, max_per_ip=4))
    a1, a2, a3 = (admit_in(gate, "a", "N") for _ in range(3))
    admit_in(gate, "c", "M")
    gate.started(a1)
    assert gate.admit("b", "N").evicted == a2  # N holds the most, b would not gain it: a holds the most within N
    assert gate.admit("d", "O").evicted == a3  # N holds the most (3): of it a holds the most (2), its idle one
    assert gate.admit("e", "O") is Refusal.TOTAL  # N (a, b), O (d), M (c): O would hold as many as N
    assert (gate.by_network, gate.by_key) == ({"N": 2, "M": 1, "O": 1}, {"a": 1, "b": 1, "c": 1, "d": 1})


def test_a_client_at_its_cap_is_refused_also_when_its_network_could_take_a_slot_from_another():
    """Between networks the gate compares networks, not clients: a client alone in its network,
    at its cap, would still take the slot of a network of many clients holding more, and hold
    more than `max_per_ip`."""
    gate = ConnectionGate(Limits(max_connections=6, max_per_ip=2))
    for key in ("b1", "b1", "b2", "b2", "a", "a"):
        admit_in(gate, key, "A" if key == "a" else "B")
    assert gate.admit("a", "A") is Refusal.PER_IP  # its own cap met, not the total
    assert (gate.by_key, gate.evicted) == ({"b1": 2, "b2": 2, "a": 2}, 0)


def admit_in(gate: ConnectionGate, key: str, network: str) -> int:
    admitted = gate.admit(key, network)
    assert isinstance(admitted, Admitted), admitted
    return admitted.connection


async def test_a_full_server_held_by_many_addresses_of_one_network_admits_a_scrape_from_another(nursery):
    """Four addresses of 127.0.0.0/24, one connection each, fill the server: a fifth address of
    that network is refused (within it every address holds one), and a scraper from 127.0.1.0/24
    is served in the slot of the oldest of them (it was refused: every address held one)."""
    connections, port = await start(nursery, Limits(max_connections=4, max_per_ip=2, **HOLD))
    held = [await connect(port, f"127.0.0.{i}") for i in range(1, 5)]
    await settle(connections, 4)
    assert await unanswered(port, "127.0.0.5") == b""
    scraped = await scrape(port, "127.0.1.1")
    assert scraped.startswith(b"HTTP/1.1 200") and scraped.endswith(METRICS), scraped[-80:]
    assert await read_until_closed(held[0], SLACK_S) == b""
    await settle(connections, 3)
    assert (connections.gate.evicted, connections.gate.refused) == (1, {Refusal.TOTAL: 1, Refusal.PER_IP: 0})
    await close_all(connections, held)


async def test_one_address_over_its_cap_is_closed_and_counted_while_others_scrape(nursery, caplog):
    caplog.set_level(logging.WARNING, logger="p2pnet.web_limits")
    connections, port = await start(nursery, Limits(max_connections=8, max_per_ip=2, **HOLD))
    held = [await connect(port, "127.0.0.1") for _ in range(2)]
    for refused in (1, 2):
        await settle(connections, 2)  # ours (and the last scrape ended)
        assert await unanswered(port, "127.0.0.1") == b""
        assert connections.gate.refused == {Refusal.PER_IP: refused, Refusal.TOTAL: 0}
        answer = await scrape(port, "127.0.0.2")  # the operator's scraper, elsewhere
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(METRICS), answer[:80]
    warnings = [r.getMessage() for r in caplog.records if r.name == "p2pnet.web_limits"]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0], warnings  # one a minute, naming the address
    registry = CollectorRegistry(auto_describe=False)
    registry.register(connections)
    await settle(connections, 2)
    text = generate_latest(registry).decode()
    assert 'p2pnet_http_connections_refused_total{cap="per_ip"} 2.0' in text and "p2pnet_http_connections 2.0" in text
    await close_all(connections, held)


async def test_a_client_at_its_cap_on_a_full_server_is_counted_as_refused_by_its_own_cap(nursery):
    """What the operator reads off /metrics names the greedy client's cap, not the server's, also
    when the server is full: the total cap is met only by a newcomer that would gain nothing."""
    connections, port = await start(nursery, Limits(max_connections=4, max_per_ip=2, **HOLD))
    held = [await connect(port, source) for source in ("127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2")]
    await settle(connections, 4)
    assert await unanswered(port, "127.0.0.1") == b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(connections)
    text = generate_latest(registry).decode()
    assert 'p2pnet_http_connections_refused_total{cap="per_ip"} 1.0' in text, text
    assert 'p2pnet_http_connections_refused_total{cap="total"} 0.0' in text, text
    await close_all(connections, held)


async def test_a_full_server_where_every_client_holds_one_refuses_until_a_connection_ends(nursery):
    """The residue of fair sharing: as many clients as the cap, one connection each, fill the
    server (taking one would only trade a client for another)."""
    connections, port = await start(nursery, Limits(max_connections=3, max_per_ip=2, **HOLD))
    held = [await connect(port, source) for source in ("127.0.0.1", "127.0.0.2", "127.0.0.3")]
    await settle(connections, 3)
    assert await unanswered(port, "127.0.0.4") == b""
    assert await unanswered(port, "127.0.0.1") == b""
    assert (connections.gate.refused, connections.gate.evicted) == ({Refusal.TOTAL: 2, Refusal.PER_IP: 0}, 0)
    held.pop(0).close()
    await settle(connections, 2)
    assert (await scrape(port, "127.0.0.4")).startswith(b"HTTP/1.1 200")
    await close_all(connections, held)


async def test_a_full_server_admits_a_scrape_in_place_of_an_idle_connection_of_the_client_holding_the_most(
        nursery, caplog):
    """Two attacker addresses fill the server; a scraper from a third is served whole, in the slot
    of the oldest idle connection of the clients holding the most, which is closed: not the older
    one of the same client that is answering a request (it gets its whole response), nor the
    other attacker's."""
    caplog.set_level(logging.WARNING, logger="p2pnet.web_limits")
    entered, answer = trio.Event(), trio.Event()

    async def snapshot() -> dict:
        entered.set()
        await answer.wait()
        return {"slow": True}

    connections = Connections(Limits(max_connections=4, max_per_ip=2, **HOLD))
    app = WebApp(snapshot=snapshot, metrics=lambda: METRICS, health=lambda: None)
    port = int((await nursery.start(partial(serve, app, "127.0.0.1:0", connections=connections))).rsplit(":", 1)[1])
    busy = await connect(port, "127.0.0.1")
    await busy.send(b"GET /api/dashboard HTTP/1.1\r\nHost: x\r\n\r\n")
    await entered.wait()
    idle = [await connect(port, source) for source in ("127.0.0.1", "127.0.0.2", "127.0.0.2")]
    await settle(connections, 4)
    scraped = await scrape(port, "127.0.0.3")
    assert scraped.startswith(b"HTTP/1.1 200") and scraped.endswith(METRICS), scraped[-80:]
    assert await read_until_closed(idle[0], SLACK_S) == b""
    answer.set()
    out = b""
    with trio.fail_after(SLACK_S):
        while not out.endswith(b'{"slow": true}'):
            data = await busy.recv(1 << 16)
            assert data, out
            out += data
    assert out.startswith(b"HTTP/1.1 200")
    await settle(connections, 3)  # the scrape has ended; the evicted connection has been released
    assert connections.gate.by_key == {"127.0.0.1": 1, "127.0.0.2": 2}
    assert (connections.gate.evicted, connections.gate.refused) == (1, {Refusal.TOTAL: 0, Refusal.PER_IP: 0})
    warnings = [r.getMessage() for r in caplog.records if r.name == "p2pnet.web_limits"]
    assert len(warnings) == 1 and "of 127.0.0.1" in warnings[0] and "from 127.0.0.3" in warnings[0], warnings
    registry = CollectorRegistry(auto_describe=False)
    registry.register(connections)
    assert "p2pnet_http_connections_evicted_total 1.0" in generate_latest(registry).decode()
    await close_all(connections, [busy, *idle])


async def test_a_connection_that_waits_for_its_client_to_close_after_its_last_response_is_idle(nursery):
    """After a last response (Connection: close) the server waits for its client's end of stream
    (`ConnectionServer`, up to `idle_s`); its application's task waited with it, so the connection
    was counted busy meanwhile, and a full server took the slot of its client's other, idle, one
    (one opened after it, here) rather than of the older, which was done."""
    connections, port = await start(nursery, Limits(max_connections=2, max_per_ip=2, **HOLD))
    done = await connect(port, "127.0.0.1")
    await done.send(SCRAPE)
    assert (await read_until_closed(done, SLACK_S)).endswith(METRICS)  # our end of stream; it keeps its own open
    kept = await connect(port, "127.0.0.1")  # it will ask later
    await settle(connections, 2)
    assert (await scrape(port, "127.0.0.2")).endswith(METRICS)  # in the slot of the oldest idle one
    await kept.send(KEEP_ALIVE)
    assert (await read_response(kept)).startswith(b"HTTP/1.1 200")
    assert connections.gate.evicted == 1
    await close_all(connections, [done, kept])


async def test_a_request_that_never_arrives_whole_and_an_idle_connection_are_closed(nursery):
    idle_s = 1.0  # an honest client here only has to send its request within this of connecting
    connections, port = await start(nursery, Limits(idle_s=idle_s, lifetime_s=600.0))
    with await connect(port) as stalled:  # half a request, then nothing
        await stalled.send(KEEP_ALIVE[:20])
        assert await read_until_closed(stalled, idle_s + SLACK_S) == b""

    with await connect(port) as dribbling:  # a byte at a time, each well within idle_s
        async def dribble() -> None:
            try:
                for byte in KEEP_ALIVE[:-2] + b"X-Pad: " + b"a" * 10_000:
                    await dribbling.send(bytes([byte]))
                    await trio.sleep(idle_s / 4)
            except OSError:  # the server closed
                pass

        async with trio.open_nursery() as clients:
            clients.start_soon(dribble)
            assert await read_until_closed(dribbling, idle_s + SLACK_S) == b""
            clients.cancel_scope.cancel()

    with await connect(port) as kept:  # two requests on one connection (pipelined: a client paused
        await kept.send(KEEP_ALIVE * 2)  # between them would rightly be closed), then idle
        both = b""
        with trio.fail_after(SLACK_S):
            while both.count(METRICS) < 2:
                data = await kept.recv(1 << 16)
                assert data, both
                both += data
        assert both.startswith(b"HTTP/1.1 200") and both.count(b"HTTP/1.1 200 ") == 2
        assert await read_until_closed(kept, idle_s + SLACK_S) == b""
    await settle(connections, 0)


async def test_a_polling_client_is_asked_to_reconnect_before_the_lifetime(nursery):
    page = (Path(p2pnet.__file__).parent / "dashboard.html").read_text()
    poll_s = int(re.search(r"setInterval\(refresh, (\d+)\)", page).group(1)) / 1000
    assert KEEP_ALIVE_MAX_REQUESTS * poll_s < Limits().lifetime_s  # an open tab is never cut mid-request
    connections, port = await start(nursery, Limits(**HOLD))
    with await connect(port) as sock:
        answers = []
        for _ in range(KEEP_ALIVE_MAX_REQUESTS):
            await sock.send(KEEP_ALIVE)
            answers.append(await read_response(sock))
        assert [b"connection: close" in answer for answer in answers] == [False] * (len(answers) - 1) + [True]
        assert await read_until_closed(sock, SLACK_S) == b""
    await settle(connections, 0)


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """The responses in what a server sent on one connection, each (status, body) and each whole:
    a response cut short (its head without all of its body) fails the test."""
    client = h11.Connection(h11.CLIENT)
    client.receive_data(data)
    client.receive_data(b"")  # what was sent is all there is
    out: list[tuple[int, bytes]] = []
    while True:
        client.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        client.send(h11.EndOfMessage())
        status, body = 0, b""
        while True:
            try:
                event = client.next_event()
            except h11.RemoteProtocolError as exc:  # the end of stream came inside a response
                pytest.fail(f"response {len(out) + 1} of {status}: {exc}")
            if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
        if isinstance(event, h11.ConnectionClosed):
            return out
        out.append((status, body))
        if client.our_state is not h11.DONE or client.their_state is not h11.DONE:  # it asked to close
            assert client.next_event() == h11.ConnectionClosed(), "bytes after the last response"
            return out
        client.start_next_cycle()


async def test_a_pipelining_client_gets_every_response_it_is_promised_whole(nursery):
    """A client that pipelines more requests than one connection carries gets
    `KEEP_ALIVE_MAX_REQUESTS` responses, each whole, the last asking it to reconnect, then an end of
    stream. The head of that last response says Connection: close, after which hypercorn takes any
    byte as the client's error and closed the connection at once, cutting the body it had just
    promised: about half such clients lost it (trio orders runnable tasks at random, hence
    `ATTEMPTS` of each), and every one whose next request came while the responses before it were
    still being read (a body larger than the sockets' buffers). Also when exactly as many are sent."""
    body = b"#" * (1 << 20)
    connections, port = await start(nursery, Limits(**HOLD), metrics=body)
    whole = [(200, body)] * KEEP_ALIVE_MAX_REQUESTS
    for extra in (0, 1, 5):
        for _ in range(ATTEMPTS):
            with await connect(port) as sock:
                await sock.send(KEEP_ALIVE * (KEEP_ALIVE_MAX_REQUESTS + extra))
                assert responses(await read_until_closed(sock, SLACK_S)) == whole, extra
    for _ in range(ATTEMPTS):
        with await connect(port) as sock:  # the rest sent once the first response is coming
            await sock.send(KEEP_ALIVE * KEEP_ALIVE_MAX_REQUESTS)
            first = await sock.recv(1 << 16)
            await sock.send(KEEP_ALIVE + b"x" * (1 << 18))
            assert responses(first + await read_until_closed(sock, SLACK_S)) == whole
    await settle(connections, 0)
    with await connect(port) as sock:  # one that leaves inside the last response is forgotten at once
        await sock.send(KEEP_ALIVE * (KEEP_ALIVE_MAX_REQUESTS + 1))
        got = b""
        with trio.fail_after(SLACK_S):
            while got.count(b"HTTP/1.1 200") < KEEP_ALIVE_MAX_REQUESTS:
                got += await sock.recv(1 << 16)
        reset(sock)
    await settle(connections, 0)  # not at the lifetime (600 s)


async def test_the_last_responses_are_not_reset_away_by_bytes_their_client_sent_past_them(nursery):
    """The server ends a connection after `KEEP_ALIVE_MAX_REQUESTS` responses. A client that
    pipelined more requests, and more bytes after them, left bytes unread in the server's socket
    when it closed, and Linux answers such a close with a reset that drops what the server had not
    yet delivered: the last responses were cut (`ConnectionServer`'s lingering close, which now
    reads and drops those bytes until the client closes). This client reads nothing until the
    server has read all it sent (lingering) or reset the connection (which ends its sending), so
    the responses are still on their way when the server closes."""
    body = b"#" * (4 << 10)  # 20 of them: more than the client's socket takes in while it reads nothing
    extra = b"x" * (16 << 20)  # more than the sockets' buffers hold: all sent only once the server reads it
    connections, port = await start(nursery, Limits(**HOLD), metrics=body)
    for _ in range(5):  # without the linger, each lost its last responses
        with await connect(port) as sock:
            await sock.send(KEEP_ALIVE * (KEEP_ALIVE_MAX_REQUESTS + 5))
            with trio.fail_after(SLACK_S), contextlib.suppress(ConnectionResetError, BrokenPipeError):
                await send_all(sock, extra)
            assert responses(await read_until_closed(sock, SLACK_S)) == [(200, body)] * KEEP_ALIVE_MAX_REQUESTS
    await settle(connections, 0)


async def test_a_client_that_leaves_is_forgotten_at_once(nursery):
    connections, port = await start(nursery, Limits(max_connections=8, max_per_ip=1, **HOLD))
    with await connect(port) as sock:  # connects, says nothing, leaves
        await settle(connections, 1)
    await settle(connections, 0)  # not after idle_s (300 s)
    with await connect(port) as sock:  # a keep-alive request, half of the next one, then it leaves
        await sock.send(KEEP_ALIVE)
        assert (await read_response(sock)).startswith(b"HTTP/1.1 200")
        await sock.send(KEEP_ALIVE[:20])
    await settle(connections, 0)
    with await connect(port) as sock:  # a request, then the client's end of stream: it still gets its answer
        await sock.send(KEEP_ALIVE)
        sock.shutdown(socket.SHUT_WR)
        assert (await read_until_closed(sock, SLACK_S)).startswith(b"HTTP/1.1 200")
    await settle(connections, 0)
    assert connections.gate.refused == {Refusal.TOTAL: 0, Refusal.PER_IP: 0}


async def test_a_client_that_does_not_read_is_cut_at_the_lifetime(nursery):
    lifetime_s = 1.0
    body = b"#" * (16 << 20)  # far more than loopback's socket buffers (4 MiB to send, 4 KiB to receive)
    connections, port = await start(nursery, Limits(idle_s=0.5, lifetime_s=lifetime_s), metrics=body)
    with (await stop_reading_mid_response(port) as reader, await connect(port) as h2,
          await stop_reading_mid_response(port, SCRAPE) as breaking):
        await h2.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # HTTP/2, and then no stream: no idle timer runs
        # a byte after a request that asked to close: hypercorn closes the connection, which waits
        # for the write in flight (`ConnectionServer._close`); the reset at the lifetime ends both
        await breaking.send(b"x")
        with trio.fail_after(lifetime_s + SLACK_S):
            await connections.wait_open(0)
        assert len(await read_until_closed(reader, SLACK_S)) < len(body)
        assert len(await read_until_closed(breaking, SLACK_S)) < len(body)
        await read_until_closed(h2, SLACK_S)
    assert (await scrape(port, "127.0.0.2")).startswith(b"HTTP/1.1 200")  # the server goes on


async def test_a_client_that_does_not_read_does_not_hold_the_shutdown(nursery):
    body = b"#" * (16 << 20)
    stopped = trio.Event()
    server = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        with server:
            async with trio.open_nursery() as inner:
                task_status.started((await start(inner, Limits(**HOLD), metrics=body))[1])
        stopped.set()

    port = await nursery.start(run)
    with await stop_reading_mid_response(port) as reader, await stop_reading_mid_response(port, SCRAPE) as breaking:
        await breaking.send(b"x")  # hypercorn closes it, which waits for its write in flight
        server.cancel()
        with trio.move_on_after(SLACK_S):
            await stopped.wait()
    assert stopped.is_set(), "the server was still stopping while a client did not read"


def test_the_hypercorn_pin_admits_only_the_releases_whose_internals_web_uses():
    """`p2pnet.web.ConnectionServer` subclasses hypercorn's internal `TCPServer` (its constructor,
    `_read_data`, `_close`, `protocol_send`, `send_lock`, `WorkerContext.terminated`, and
    `H11Protocol`'s `stream` and `connection` (which it replaces once, kept for the connection's next
    requests, and whose `they_are_waiting_for_100_continue` `_handle_events` reads), `H2Protocol`'s
    `closed`, `connection`, `streams`, `stream_buffers` and `_handle_events`),
    the same in 0.17.0 to
    0.18.0 and absent from 0.16 (no lifespan state): the pin must keep a fresh install inside
    that range, not let it pick up the next release, whose internals nobody has checked."""
    pyproject = tomllib.loads((Path(p2pnet.__file__).parents[1] / "pyproject.toml").read_text())
    pin = next(Requirement(line) for line in pyproject["project"]["dependencies"]
               if Requirement(line).name == "hypercorn").specifier
    installed = Version(importlib.metadata.version("hypercorn"))
    assert installed in pin
    assert Version("0.17.0") in pin and Version("0.16.0") not in pin
    newest_checked = Version("0.18.0")  # the next minor release after it is unchecked, whatever is installed
    assert Version(f"{newest_checked.major}.{newest_checked.minor + 1}.0") not in pin, pin


def h2_requests(streams: int, window: int) -> tuple[h2.connection.H2Connection, bytes]:
    """An HTTP/2 client (prior knowledge) that asks for /metrics on `streams` streams at once,
    with a receive window of `window` bytes per stream (0: it will take nothing)."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    for stream_id in range(1, 2 * streams, 2):
        client.send_headers(stream_id, [(":method", "GET"), (":path", "/metrics"), (":scheme", "http"),
                                        (":authority", "x")], end_stream=True)
    return client, client.data_to_send()


async def test_an_http2_client_holds_one_response_per_connection_as_http1_does(nursery):
    """Each connection may hold one response a client does not take (the caps bound connections,
    so they bound those responses): an HTTP/2 client that opens many streams at once and takes
    nothing is closed at once (hypercorn allowed 100 such streams, each holding its response
    until the lifetime), and one that asks on one stream at a time is served."""
    renders = []

    def metrics() -> bytes:
        renders.append(1)
        return METRICS

    async def snapshot() -> dict:
        return {}

    connections = Connections(Limits(**HOLD))
    app = WebApp(snapshot=snapshot, metrics=metrics, health=lambda: None)
    port = int((await nursery.start(partial(serve, app, "127.0.0.1:0", connections=connections))).rsplit(":", 1)[1])
    with await connect(port) as greedy:
        await greedy.send(h2_requests(streams=50, window=0)[1])
        await read_until_closed(greedy, SLACK_S)
    assert len(renders) <= 1, len(renders)
    with await connect(port) as polite:
        client, data = h2_requests(streams=1, window=1 << 16)
        await polite.send(data)
        events: list[h2.events.Event] = []
        with trio.fail_after(SLACK_S):
            while not any(isinstance(event, h2.events.StreamEnded) for event in events):
                received = await polite.recv(1 << 16)
                assert received, events
                events += client.receive_data(received)
                await polite.send(client.data_to_send())
    status = next(dict(event.headers)[b":status"] for event in events if isinstance(event, h2.events.ResponseReceived))
    body = b"".join(event.data for event in events if isinstance(event, h2.events.DataReceived))
    assert (status, body) == (b"200", METRICS)
    await settle(connections, 0)


H2C_UPGRADE = (b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
               b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")


async def test_an_h2c_upgrade_followed_by_bytes_that_are_not_http2_is_forgotten_once_its_client_leaves(nursery):
    """hypercorn answers an h2c upgrade (101) and serves its request as HTTP/2 stream 1; bytes
    after it that are not HTTP/2 close the connection, and the response's writer, waiting on its
    stream's buffer for a sending task that had ended with the connection, held the connection
    until the lifetime's reset (part of the time: it depends on which task trio runs first, hence
    `ATTEMPTS`). Its client is told at once (an end of stream), and once it closes its end the
    connection is forgotten."""
    connections, port = await start(nursery, Limits(**HOLD))
    for stray in (b"x", b"xyz" * 10, b"\0" * 100):
        for _ in range(ATTEMPTS):
            with await connect(port) as sock:
                await sock.send(H2C_UPGRADE + stray)
                assert (await read_until_closed(sock, SLACK_S)).startswith(b"HTTP/1.1 101")
            await settle(connections, 0)  # not at the lifetime (600 s)


async def test_a_response_in_flight_at_the_lifetime_is_finished_then_the_connection_closed(nursery):
    """The lifetime asks a connection to close once its response in flight is sent, and resets it
    only `idle_s` later: a keep-alive client whose page takes longer than the lifetime has left
    (a slow `p2pnet dashboard` polled on one connection) gets its whole response, then an end
    of stream, not a reset in the middle. The page's own pace (it answers `lifetime_s` after it
    is asked, so the lifetime passes while it works) is the one wait here besides the deadlines."""
    limits = Limits(idle_s=2.0, lifetime_s=3.0)
    entered = trio.Event()

    async def snapshot() -> dict:
        entered.set()
        await trio.sleep(limits.lifetime_s)
        return {"slow": True}

    connections = Connections(limits)
    app = WebApp(snapshot=snapshot, metrics=lambda: METRICS, health=lambda: None)
    port = int((await nursery.start(partial(serve, app, "127.0.0.1:0", connections=connections))).rsplit(":", 1)[1])
    with await connect(port) as polling:
        await polling.send(b"GET /api/dashboard HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await read_until_closed(polling, limits.lifetime_s + SLACK_S)
    assert entered.is_set()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"slow": true}'), answer[-80:]
    await settle(connections, 0)


async def send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await sock.send(view):]


BODY_BYTES = 64 << 20  # more than hypercorn's queue and loopback's socket buffers hold (32 MiB in, 4 MiB out)
BODIES = [  # a request with a body no route takes, and the status it is answered with
    (b"GET /api/dashboard HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % BODY_BYTES, b"HTTP/1.1 413"),
    (b"POST /api/dashboard HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % BODY_BYTES, b"HTTP/1.1 405"),
    (b"GET /api/dashboard HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"HTTP/1.1 413"),
]


async def start_slow(nursery: trio.Nursery, ready: trio.Event, fails: bool = False) -> tuple[Connections, int]:
    """A server whose dashboard answers once `ready` is set (the dashboard process asks its peer),
    or then fails (`fails`: a bug of ours)."""
    async def snapshot() -> dict:
        await ready.wait()
        if fails:
            raise RuntimeError("a failing page")
        return {}

    return await start(nursery, Limits(**HOLD), snapshot=snapshot)


async def test_a_request_that_declares_a_body_is_refused_at_once_and_its_connection_closed(nursery):
    """No route takes a body. hypercorn queues one for the application, 10 reads deep, and its
    reader waits while the queue is full, as did the end of the response (it queues the request's
    end): a body larger than that, arriving while a page took its time (here, until its client has
    sent the whole body), was never answered and held its connection until the lifetime's reset.
    A request that declares a body is answered at once (413 on GET, 405 on a method no route
    serves) with Connection: close, and the server ends its side of the connection then, whatever
    its client goes on sending."""
    sent = trio.Event()
    connections, port = await start_slow(nursery, sent)
    piece = b"5\r\nxxxxx\r\n" * (1 << 16)  # 640 KiB of valid chunks; a declared body's bytes too
    for head, status in BODIES:
        with await connect(port) as sock:
            async def send_body() -> None:
                await sock.send(head)
                for _ in range(BODY_BYTES // len(piece) + 1):
                    await send_all(sock, piece)
                sent.set()

            async with trio.open_nursery() as client:
                client.start_soon(send_body)
                answer = await read_until_closed(sock, SLACK_S)
                client.cancel_scope.cancel()
        assert answer.startswith(status) and b"connection: close" in answer, answer[:200]
        assert (b"allow: GET, HEAD" in answer) == status.endswith(b"405"), answer[:200]
        await settle(connections, 0)
    assert connections.failed == 0


@pytest.mark.parametrize("fails", [False, True], ids=["page", "failing page"])
async def test_an_http2_body_no_header_declares_is_read_and_dropped_while_its_request_is_answered(nursery, fails):
    """An HTTP/2 stream carries a body without declaring it (no Content-Length): the server cannot
    refuse it up front, so it reads and drops it while the page is made, then answers; hypercorn's
    queue, full, stopped its reader (and with it the client's flow-control window) and held the
    connection until the lifetime's reset. DATA the client goes on sending after the answer made
    hypercorn fail (a KeyError: it forgets an answered stream); it now closes the connection, as
    HTTP/1.1's is closed. So is a page that fails while the body arrives, answered with
    hypercorn's 500."""
    sent = trio.Event()
    connections, port = await start_slow(nursery, sent, fails)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "GET"), (":path", "/api/dashboard"), (":scheme", "http"),
                            (":authority", "x")])  # and no end of stream: a body follows
    events: list[h2.events.Event] = []
    received = trio.Event()  # anything from the server (a window opened, for one)
    with await connect(port) as sock:
        async def send_body() -> None:
            nonlocal received
            body = 0
            with contextlib.suppress(OSError, h2.exceptions.StreamClosedError):
                while True:
                    room = min(client.local_flow_control_window(1), client.max_outbound_frame_size)
                    if room:
                        client.send_data(1, b"x" * room)
                        body += room
                    await send_all(sock, client.data_to_send())
                    if body >= BODY_BYTES // 16:  # more than the queue and the window hold
                        sent.set()
                    if not room:
                        await received.wait()
                        received = trio.Event()

        async with trio.open_nursery() as sender:
            sender.start_soon(send_body)
            with trio.fail_after(SLACK_S), contextlib.suppress(ConnectionResetError):
                while data := await sock.recv(1 << 16):
                    events += client.receive_data(data)
                    received.set()
            sender.cancel_scope.cancel()
    assert sent.is_set()
    assert [dict(event.headers)[b":status"] for event in events if isinstance(event, h2.events.ResponseReceived)] \
        == [b"500" if fails else b"200"]
    await settle(connections, 0)
    assert connections.failed == 0


async def test_a_key_error_below_hypercorns_lookup_of_an_answered_stream_is_still_a_failure(nursery, monkeypatch):
    """`ConnectionServer` takes hypercorn's KeyError for DATA on an answered HTTP/2 stream as its
    client's doing and closes the connection quietly; a KeyError raised deeper, by what that loop
    calls (here a stream's handling of the body, standing for a bug of ours or hypercorn's), is
    not that and ends the connection as the failure it is, counted. Told apart by the key alone
    (an int that names no open stream), it was swallowed."""
    handle = HTTPStream.handle

    async def failing_handle(self: HTTPStream, event: object) -> None:
        if isinstance(event, Body):
            raise KeyError(99)
        await handle(self, event)

    monkeypatch.setattr(HTTPStream, "handle", failing_handle)
    connections, port = await start(nursery, Limits(**HOLD))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "GET"), (":path", "/metrics"), (":scheme", "http"), (":authority", "x")])
    client.send_data(1, b"x")
    with await connect(port) as sock:
        await send_all(sock, client.data_to_send())
        await read_until_closed(sock, SLACK_S)
    await settle(connections, 0)
    assert connections.failed == 1


WEBSOCKET = (b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
             b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
FRAMING_BREAKERS = [
    KEEP_ALIVE * (KEEP_ALIVE_MAX_REQUESTS + 1),  # more pipelined than one connection carries
    SCRAPE + KEEP_ALIVE,  # a request after one that asked to close
    b"GET /metrics HTTP/1.0\r\n\r\n" + KEEP_ALIVE,  # a request after an HTTP/1.0 one
    WEBSOCKET + b"x",  # a byte before the handshake is answered
    WEBSOCKET,  # a websocket: we serve none
]
ATTEMPTS = 20


async def test_a_client_that_breaks_http_framing_logs_no_traceback_and_the_server_goes_on(nursery, caplog):
    """Bytes after a request that asked to close, or after the request a connection ends with,
    made hypercorn end the connection while our response was being written: its end of stream
    and our write met on the socket (BusyResourceError), which it logged as an error of ours or,
    when its own error response was the write, ended the whole server (and the peer). A byte
    before a websocket handshake is answered made two tasks answer it at once, which ended the
    server every time. Each of the first three hit the race about a third to a half of the time
    without the fix (trio orders runnable tasks at random), hence `ATTEMPTS` of each. An error of
    our own (a failing page) is still logged, with its traceback."""
    caplog.set_level(logging.INFO)

    async def snapshot() -> dict:
        raise RuntimeError("our own bug")

    connections = Connections(Limits(**HOLD))
    app = WebApp(snapshot=snapshot, metrics=lambda: METRICS, health=lambda: None)
    port = int((await nursery.start(partial(serve, app, "127.0.0.1:0", connections=connections))).rsplit(":", 1)[1])
    for payload in FRAMING_BREAKERS:
        for _ in range(ATTEMPTS):
            with await connect(port) as sock:
                await sock.send(payload)
                await read_until_closed(sock, SLACK_S)
    await settle(connections, 0)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert (await scrape(port, "127.0.0.1")).endswith(METRICS)
    with await connect(port) as sock:
        await sock.send(b"GET /api/dashboard HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await read_until_closed(sock, SLACK_S)).startswith(b"HTTP/1.1 500")
    assert [str(r.exc_info[1]) for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info] == ["our own bug"]


async def test_an_error_serving_one_connection_ends_it_alone_logged_once_a_minute_and_counted(nursery, caplog):
    """A bug met while serving one connection (ours or hypercorn's: an exception out of its
    `TCPServer`, as BusyResourceError and LocalProtocolError were) ends that connection only, with
    its traceback in the log (once a minute: the next ones counted) and a count; it used to end
    `Connections.serve`, and with it the server and the peer. Another connection open meanwhile is
    served whole."""
    caplog.set_level(logging.ERROR, logger="p2pnet.web_limits")
    connections = Connections(Limits(**HOLD))

    async def serve_one(stream: trio.SocketStream, wind_down: trio.Event, busy: object) -> None:
        if await stream.receive_some(1 << 16) == b"fail":
            raise RuntimeError("a bug met by one connection")
        await stream.send_all(b"served")

    with trio.socket.socket() as listener:
        await listener.bind(("127.0.0.1", 0))
        listener.listen()
        nursery.start_soon(connections.serve, listener, serve_one)
        port = listener.getsockname()[1]
        with await connect(port) as other:
            await settle(connections, 1)
            for _ in range(3):  # a client that meets the bug at will gets one traceback a minute logged
                with await connect(port, "127.0.0.2") as failing:
                    await failing.send(b"fail")
                    assert await read_until_closed(failing, SLACK_S) == b""
            await other.send(b"hello")
            assert await read_until_closed(other, SLACK_S) == b"served"
        await settle(connections, 0)
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failures) == 1 and "from 127.0.0.2" in failures[0].getMessage(), failures
    assert "a bug met by one connection" in caplog.text  # the traceback, with the error
    registry = CollectorRegistry(auto_describe=False)
    registry.register(connections)
    assert "p2pnet_http_connections_failed_total 3.0" in generate_latest(registry).decode()


class FailingAccepts:
    """A listener whose next accepts fail with `errnos` (what Linux's accept() passes on from a
    new connection: accept(2)), then accepts as `listener` does."""

    def __init__(self, listener: trio.socket.SocketType, errnos: list[int]) -> None:
        self.listener, self.errnos = listener, errnos

    async def accept(self) -> tuple[trio.socket.SocketType, object]:
        if self.errnos:
            await trio.lowlevel.checkpoint()
            code = self.errnos.pop(0)
            raise OSError(code, os.strerror(code))
        return await self.listener.accept()


async def test_a_network_error_that_accept_passes_on_from_one_connection_does_not_stop_the_server(nursery):
    """accept() on Linux returns a new connection's pending network error (a route gone, a reset,
    a timeout), which a client can cause: the server skips it and goes on, as trio's own listener
    does; it used to end the server, and the peer, on any but three."""
    connections = Connections(Limits(**HOLD))

    async def serve_one(stream: trio.SocketStream, wind_down: trio.Event, busy: object) -> None:
        await stream.send_all(b"served")

    errnos = [errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ETIMEDOUT, errno.ECONNRESET, errno.ENETDOWN]
    with trio.socket.socket() as listener:
        await listener.bind(("127.0.0.1", 0))
        listener.listen()
        nursery.start_soon(connections.serve, FailingAccepts(listener, errnos), serve_one)
        with await connect(listener.getsockname()[1]) as sock:
            assert await read_until_closed(sock, SLACK_S) == b"served"
    assert errnos == []
    await settle(connections, 0)


async def test_a_connection_evicted_inside_a_write_its_client_does_not_read_is_reset_at_once(nursery):
    """The victim of an eviction may be inside hypercorn's shielded write to a client that does not
    read: it ends at once (its slot is not held until the lifetime), and with a reset, so the kernel
    drops the megabytes of response it still held for that client instead of going on delivering
    them."""
    body = b"#" * (16 << 20)
    connections, port = await start(nursery, Limits(max_connections=2, max_per_ip=2, **HOLD), metrics=body)
    with await stop_reading_mid_response(port) as victim, await stop_reading_mid_response(port) as other:
        with await connect(port, "127.0.0.2"):  # 127.0.0.1 holds both, busy: its oldest is taken
            with pytest.raises(ConnectionResetError), trio.fail_after(SLACK_S):
                while await victim.recv(1 << 16):
                    pass
            await settle(connections, 2)
            assert connections.gate.evicted == 1
            assert connections.gate.by_key == {"127.0.0.1": 1, "127.0.0.2": 1}
        other.close()
    await settle(connections, 0)

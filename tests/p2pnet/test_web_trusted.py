"""The operator's share of the peer's HTTP server (`p2pnet.web_limits`: `Limits.trusted_networks`,
`trusted_reserve`): strangers never hold the last few connections, so the operator's scraper gets
its answer when strangers in more networks than the server has slots fill the rest, and neither
kind takes a slot of the other's. The gate's rules on their own, then real sockets on loopback
against the real server: each 127.0.N.1 is a network of its own (a /24), and 127.200.0.0/24
plays the operator's (loopback as a whole, which the peer trusts always, would make every test
client the operator's)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from p2pnet.errors import ConfigError
from p2pnet.node import PeerConfig
from p2pnet.web import WebApp, serve, serve_peer_http
from p2pnet.localnet import start_peer
from p2pnet.web_limits import LOOPBACK, Admitted, ConnectionGate, Connections, Limits, Refusal, too_wide, trusting
from tests.p2pnet.test_web_limits import (HOLD, METRICS, SLACK_S, connect, read_until_closed, scrape, settle, start,
                                          unanswered)

OPERATOR = "127.200.0.0/24"


def test_trusted_networks_and_the_peers_share():
    limits = trusting(("192.0.2.0/24", "2001:db8::/48"))
    assert limits.trusted_networks == (*LOOPBACK, "192.0.2.0/24", "2001:db8::/48")
    assert [limits.trusts(host) for host in ("127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1", "192.0.2.200",
                                             "::ffff:192.0.2.1", "2001:db8:0:ff::1%eth0")] == [True] * 7
    assert [limits.trusts(host) for host in ("192.0.3.1", "2001:db8:1::1", "::2", "10.0.0.1")] == [False] * 4
    assert (limits.share(trusted=True), limits.share(trusted=False)) == (64, 56)
    assert Limits().share(False) == 64  # no trusted network: nothing is kept
    with pytest.raises(ValueError, match="not-a-network"):
        Limits(trusted_networks=("not-a-network",))
    with pytest.raises(ValueError):
        Limits(max_connections=4, max_per_ip=2, trusted_networks=(OPERATOR,), trusted_reserve=4)
    config = PeerConfig(data_dir="x", metrics_trusted_networks=("192.0.2.0/24", "2001:db8::1"))
    assert config.metrics_trusted_networks == ("192.0.2.0/24", "2001:db8::1")
    with pytest.raises(ConfigError, match="metrics_trusted_networks.*192.0.2.0/33"):
        PeerConfig(data_dir="x", metrics_trusted_networks=("192.0.2.0/33",))


def test_a_trusted_network_is_read_as_a_clients_address_is_and_one_with_host_bits_set_is_refused():
    """A client arriving IPv4-mapped is matched as IPv4, so an IPv4-mapped network is the IPv4
    one; 192.0.2.7/24 is as likely a mistyped prefix as a network (10.0.0.1/0 would trust every
    stranger): the operator is told what to write."""
    limits = trusting(("::ffff:192.0.2.0/120",))
    assert limits.trusts("::ffff:192.0.2.9") and limits.trusts("192.0.2.9") and not limits.trusts("192.0.3.9")
    for written, meant in (("192.0.2.7/24", "192.0.2.0/24"), ("10.0.0.1/0", "0.0.0.0/0"),
                           ("2001:db8::1/48", "2001:db8::/48")):
        with pytest.raises(ConfigError, match=f"metrics_trusted_networks.*{written}.*host bits.*{meant}"):
            PeerConfig(data_dir="x", metrics_trusted_networks=(written,))
        with pytest.raises(ValueError, match="host bits"):
            Limits(trusted_networks=(written,))


def test_a_forwarder_on_loopback_holds_one_clients_share_of_the_operators():
    """A reverse proxy on the peer's machine brings strangers in from loopback, trusted: it holds
    at most its cap, and the operator's scraper from a configured network takes one of its slots
    when strangers hold theirs."""
    limits = trusting(("192.0.2.0/24",))
    gate = ConnectionGate(limits)
    for n in range(56):
        admit(gate, f"198.51.{n}.1", f"198.51.{n}.0/24")
    proxied = [admit(gate, "127.0.0.1", "127.0.0.0/24", trusted=limits.trusts("127.0.0.1")) for _ in range(8)]
    assert gate.admit("127.0.0.1", "127.0.0.0/24", trusted=True) is Refusal.PER_IP  # at its cap
    assert gate.admit("192.0.2.5", "192.0.2.0/24", trusted=limits.trusts("192.0.2.5")) == Admitted(65, proxied[0])


def test_strangers_in_the_64_of_one_trusted_ipv6_address_leave_it_its_own_cap():
    """The operator may trust one address of a /64 whose other addresses are strangers' (a
    hosting provider's rack sharing one /64): a stranger counts as the /64, the trusted address
    as itself, so strangers at their cap there do not refuse the operator's scraper."""
    limits = trusting(("2001:db8::5",))
    assert limits.counted_as("2001:db8::5") == ("2001:db8::5/128", "2001:db8::/48", True)
    assert limits.counted_as("2001:db8::6%eth0") == ("2001:db8::/64", "2001:db8::/48", False)
    gate = ConnectionGate(limits)
    for n in range(limits.max_per_ip):
        admit(gate, *limits.counted_as(f"2001:db8::{n + 100:x}"))
    assert gate.admit(*limits.counted_as("2001:db8::ff")) is Refusal.PER_IP  # the strangers' /64 at its cap
    scraper = [admit(gate, *limits.counted_as("2001:db8::5")) for _ in range(limits.max_per_ip)]
    assert gate.admit(*limits.counted_as("2001:db8::5")) is Refusal.PER_IP  # the cap applies to it as to anyone
    assert (gate.open, gate.trusted, len(scraper)) == (2 * limits.max_per_ip, limits.max_per_ip, limits.max_per_ip)


def test_a_host_in_a_trusted_network_as_wide_as_a_64_holds_the_cap_of_its_64_not_of_each_address():
    """A trusted network written a /64 or wider (the operator's /48, or ::/0 meant as "trust
    all") does not say which of its addresses are one host's: a host there handed a /64, taking
    a new address for each connection, holds `max_per_ip` in all, as a stranger does, rather than
    the whole server and the operator's other clients' slots. A narrower one does say it: its
    addresses count apart from the strangers of their /64."""
    for wide in ("2001:db8::/48", "2001:db8::/64", "::/0"):
        limits = trusting((wide,))
        assert limits.counted_as("2001:db8::6") == ("2001:db8::/64", "2001:db8::/48", True), wide
        gate = ConnectionGate(limits)
        for n in range(limits.max_per_ip):
            admit(gate, *limits.counted_as(f"2001:db8::{n + 100:x}"))
        assert gate.admit(*limits.counted_as("2001:db8::ff")) is Refusal.PER_IP, wide
    limits = trusting(("2001:db8::/48", "2001:db8::/120"))  # the narrowest holding an address counts
    assert [limits.counted_as(host)[0] for host in ("2001:db8::6", "2001:db8::1:6")] == [
        "2001:db8::/120", "2001:db8::/64"]


def admit(gate: ConnectionGate, key: str, network: str, trusted: bool = False) -> int:
    admitted = gate.admit(key, network, trusted)
    assert isinstance(admitted, Admitted), admitted
    return admitted.connection


def test_strangers_hold_at_most_their_share_and_neither_kind_takes_the_others_slots():
    gate = ConnectionGate(Limits(max_connections=5, max_per_ip=2, trusted_networks=(OPERATOR,), trusted_reserve=2))
    a, b, c = (admit(gate, key, key.upper()) for key in "abc")  # three networks, one each: the strangers' share
    assert gate.admit("d", "D") is Refusal.TOTAL  # two slots free, but kept for the operator
    assert gate.admit("b", "B") is Refusal.TOTAL  # (its network would hold as many as the most)
    o, p = admit(gate, "o", "O", trusted=True), admit(gate, "p", "O", trusted=True)
    assert (gate.open, gate.trusted) == (5, 2)
    assert gate.admit("q", "Q", trusted=True) == Admitted(6, evicted=o)  # shared among the trusted: O holds the most
    gate.release(a)
    d = admit(gate, "d", "D")  # the operator's connections do not count against the strangers' share
    gate.release(b)
    r = admit(gate, "r", "R", trusted=True)  # a free slot: a trusted client may take any, past the reserve
    assert (gate.open, gate.trusted) == (5, 3)
    assert gate.admit("e", "E") is Refusal.TOTAL  # room in the strangers' share, none in the server: none is theirs
    assert gate.by_network == {"C": 1, "O": 1, "Q": 1, "D": 1, "R": 1}
    for connection in (o, c, p, 6, d, r):
        gate.release(connection)
    assert (gate.open, gate.trusted, gate.by_key, gate.closing, gate.evicted) == (0, 0, {}, {}, 1)
    assert gate.refused == {Refusal.TOTAL: 3, Refusal.PER_IP: 0}


def test_a_stranger_takes_a_slot_only_of_a_stranger_counted_among_strangers():
    """An operator's address may sit in a stranger's network (a /32 of a hosting provider's /24):
    the strangers' sharing counts only strangers there, and evicts only a stranger."""
    gate = ConnectionGate(Limits(max_connections=5, max_per_ip=3, trusted_networks=("192.0.2.7/32",),
                                 trusted_reserve=2))
    operator = [admit(gate, "192.0.2.7", "N", trusted=True) for _ in range(2)]
    s1, s2 = admit(gate, "s1", "N"), admit(gate, "s2", "N")
    m1 = admit(gate, "m1", "M")
    assert gate.by_network == {"N": 4, "M": 1}
    # among strangers N holds 2 and M 1: m2 would make M's 2, gaining nothing (counted with the
    # operator's, N would hold 4 and lose one: the operator's oldest, of the client holding the most)
    assert gate.admit("m2", "M") is Refusal.TOTAL
    assert gate.admit("x", "X").evicted == s1  # X would hold 1 < 2: N's oldest stranger, never the operator's
    assert gate.trusted == 2 and all(connection in gate.held for connection in operator) and m1 in gate.held
    assert s2 in gate.held


async def test_the_operators_scraper_is_answered_when_strangers_in_more_networks_than_slots_fill_the_rest(nursery):
    """Strangers from 70 networks (127.0.1.1 to 127.0.70.1), one connection each, more networks
    than the server has slots (64): 56 are held and 14 refused, and the operator's scraper
    (127.200.0.1) is served. Without the reserve 64 were held and the scraper refused: taking a
    slot from a network holding one would only trade one network for another."""
    connections, port = await start(nursery, Limits(trusted_networks=(OPERATOR,), **HOLD))
    strangers = [await connect(port, f"127.0.{n}.1") for n in range(1, 71)]
    # accepted in the order connected: every stranger is admitted or refused before the scrape is
    scraped = await scrape(port, "127.200.0.1")
    assert scraped.startswith(b"HTTP/1.1 200") and scraped.endswith(METRICS), scraped[-80:]
    await settle(connections, 56)  # the strangers', the scrape ended
    assert (connections.gate.refused, connections.gate.evicted) == ({Refusal.TOTAL: 14, Refusal.PER_IP: 0}, 0)
    assert len(connections.gate.by_network) == 56 and connections.gate.trusted == 0
    for refused in strangers[56:]:
        assert await read_until_closed(refused, SLACK_S) == b""
    assert await unanswered(port, "127.0.71.1") == b""  # a stranger still finds the strangers' share full
    with await connect(port, "127.200.0.2"):  # what the operator reads
        await settle(connections, 57)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(connections)
        text = generate_latest(registry).decode()
        assert "p2pnet_http_connections_trusted 1.0" in text and "p2pnet_http_connections 57.0" in text
    for sock in strangers:
        sock.close()
    await settle(connections, 0)
    assert (connections.gate.by_key, connections.gate.trusted) == ({}, 0)


async def test_the_peers_server_and_the_dashboards_trust_loopback_and_the_configured_networks(nursery, monkeypatch):
    """`serve_peer_http` bounds its connections with [peer] metrics_trusted_networks, loopback
    added (a client on loopback is counted the operator's); `serve` on its own (`p2pnet
    dashboard`) trusts loopback."""
    made: list[Connections] = []

    class Recorded(Connections):
        def __init__(self, limits: Limits | None = None) -> None:
            super().__init__(limits)
            made.append(self)

    monkeypatch.setattr("p2pnet.web.Connections", Recorded)
    node = SimpleNamespace(config=PeerConfig(data_dir="x", metrics_trusted_networks=("192.0.2.0/24",)))
    url = await nursery.start(serve_peer_http, node, "127.0.0.1:0")
    await nursery.start(serve, WebApp(snapshot=empty), "127.0.0.1:0")
    peers, dashboards = made
    assert (peers.limits, dashboards.limits) == (trusting(("192.0.2.0/24",)), trusting())
    with await connect(int(url.rsplit(":", 1)[1]), "127.0.0.1"):
        await settle(peers, 1)
        assert peers.gate.trusted == 1
    await settle(peers, 0)


async def empty() -> dict:
    return {}


def test_networks_wider_than_one_operators_are_named():
    """An IPv4 network shorter than /8 or an IPv6 one shorter than /16 is wider than any one
    operator holds (`WIDE_PREFIX`); an IPv4-mapped network counts as the IPv4 network it maps."""
    kept = ("10.0.0.0/8", "2001::/16", "192.0.2.7", "::1", "::ffff:10.0.0.0/104")
    wide = ("0.0.0.0/0", "8.0.0.0/7", "::/0", "2000::/3", "2000::/15", "fd00::/8", "::ffff:0.0.0.0/96")
    assert too_wide(kept + wide) == wide


def test_a_peer_trusting_too_wide_a_network_warns_at_start_and_in_its_status(tmp_path):
    """The real peer, configured as a user would: the warning is in its log at start, in
    `p2pnet peer status` and in its status; a network of one operator draws none; the setting is
    kept (the server still starts and trusts it)."""
    config = tmp_path / "peer.toml"
    config.write_text('[peer]\nmetrics_listen = "127.0.0.1:0"\n'
                      'metrics_trusted_networks = ["0.0.0.0/0", "10.0.0.0/8", "::/0"]\n')
    peer = start_peer("wide", tmp_path / "wide", extra_args=["--config", str(config)])
    try:
        peer.wait_ready(30)
        status = peer.status()
        text = subprocess.run([sys.executable, "-m", "p2pnet", "peer", "status", "--data-dir", str(peer.data_dir)],
                              capture_output=True, text=True, timeout=60)
        as_json = subprocess.run([sys.executable, "-m", "p2pnet", "peer", "status", "--json", "--data-dir",
                                  str(peer.data_dir)], capture_output=True, text=True, timeout=60)
    finally:
        assert peer.stop() == 0
    assert status["metrics_url"] and len(status["warnings"]) == 2
    assert json.loads(as_json.stdout)["warnings"] == status["warnings"]
    for network, warning in zip(("0.0.0.0/0", "::/0"), status["warnings"]):
        assert warning.startswith(f"[peer] metrics_trusted_networks {network} is wider")
        assert "strangers there may take the 8 connections" in warning
    shown = [line for line in text.stdout.splitlines() if line.startswith("WARNING: ")]
    assert text.returncode == 0 and shown == [f"WARNING: {w}" for w in status["warnings"]], text.stdout
    logged = [line for line in peer.log_path.read_text().splitlines() if "metrics_trusted_networks" in line]
    assert len(logged) == 2 and all("WARNING" in line for line in logged), logged
    assert [w in line for w, line in zip(status["warnings"], logged)] == [True, True]
    assert "10.0.0.0/8" not in "".join(logged)

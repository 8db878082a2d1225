"""What a peer advertises: concrete addresses other hosts can dial, never a wildcard."""

import random

import pytest

from p2pnet.addresses import advertised_addrs, advertised_data_addr, parse_host_port, same_ip, usable_ips
from p2pnet.connectivity import Backoff, dial_targets
from p2pnet.errors import ConfigError
from p2pnet.messages import DialResult
from p2pnet.reachability import ReachabilityState

PID = "12D3KooWtest"
IPS = ["127.0.0.1", "::1", "10.213.0.11", "fe80::1", "2001:db8::5", "192.168.7.2"]


def test_wildcard_listen_advertises_each_interface_but_not_loopback():
    addrs = advertised_addrs(["/ip4/0.0.0.0/tcp/4001"], (), IPS, PID)
    assert addrs == [f"/ip4/10.213.0.11/tcp/4001/p2p/{PID}", f"/ip4/192.168.7.2/tcp/4001/p2p/{PID}"]
    v6 = advertised_addrs(["/ip6/::/tcp/4001"], (), IPS, PID)
    assert v6 == [f"/ip6/2001:db8::5/tcp/4001/p2p/{PID}"]  # no ::1, no link-local fe80::


def test_loopback_only_host_advertises_loopback_and_concrete_listen_is_kept():
    assert advertised_addrs(["/ip4/0.0.0.0/tcp/5"], (), ["127.0.0.1"], PID) == [f"/ip4/127.0.0.1/tcp/5/p2p/{PID}"]
    assert advertised_addrs([f"/ip4/10.1.2.3/tcp/7/p2p/{PID}"], (), IPS, PID) == [f"/ip4/10.1.2.3/tcp/7/p2p/{PID}"]


def test_announce_overrides_and_gets_the_peer_id():
    addrs = advertised_addrs(["/ip4/0.0.0.0/tcp/4001"], ("/ip4/203.0.113.7/tcp/14001",), IPS, PID)
    assert addrs == [f"/ip4/203.0.113.7/tcp/14001/p2p/{PID}"]
    with pytest.raises(ConfigError, match="another peer id"):
        advertised_addrs([], ("/ip4/203.0.113.7/tcp/1/p2p/12D3KooWother",), IPS, PID)


def test_data_plane_address_follows_the_same_rules():
    assert advertised_data_addr("0.0.0.0", 9000, "", IPS) == "10.213.0.11:9000"
    assert advertised_data_addr("127.0.0.1", 9000, "", IPS) == "127.0.0.1:9000"
    assert advertised_data_addr("0.0.0.0", 9000, "203.0.113.7:19000", IPS) == "203.0.113.7:19000"
    assert advertised_data_addr("::", 9000, "", IPS) == "[2001:db8::5]:9000"
    assert advertised_data_addr("0.0.0.0", 9000, "", ["127.0.0.1"]) == "127.0.0.1:9000"
    assert parse_host_port("[2001:db8::5]:9000", "x") == ("2001:db8::5", 9000)
    with pytest.raises(ConfigError):
        parse_host_port("nohost", "peer.data_announce")


def test_usable_ips_and_same_ip():
    assert usable_ips(["127.0.0.1", "127.0.0.1"], 4) == ["127.0.0.1"]
    assert same_ip("::ffff:10.0.0.1", "10.0.0.1") and not same_ip("10.0.0.1", "10.0.0.2")
    assert not same_ip("not-an-ip", "10.0.0.1")


def test_backoff_doubles_to_its_cap_with_jitter_and_resets():
    backoff = Backoff(0.5, 8.0, random.Random(1))
    delays = [backoff.next() for _ in range(8)]
    ceilings = [0.5, 1, 2, 4, 8, 8, 8, 8]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings))
    assert len(set(delays)) == len(delays)  # jittered, not lockstep
    backoff.reset()
    assert backoff.next() <= 0.5


def test_dial_targets_every_bootstrap_then_known_peers():
    boot = ("/ip4/10.0.0.1/tcp/1/p2p/A", "/ip4/10.0.0.2/tcp/1/p2p/B")
    known = [("A", ("/ip4/10.0.0.1/tcp/1/p2p/A",)), ("C", ("/ip4/10.0.0.3/tcp/1/p2p/C", "x")), ("D", ())]
    assert dial_targets(boot, known) == [*boot, "/ip4/10.0.0.3/tcp/1/p2p/C"]


def test_reachability_verdicts():
    state = ReachabilityState()
    assert state.reachable is None
    assert state.probers(0.0, ["b", "a", "c", "d"], 60.0) == ["a", "b", "c"]
    assert state.probers(1.0, ["a", "b", "c", "d"], 60.0) == ["d"]  # the others were asked a second ago
    state.record(1.0, "a", DialResult.BUSY, DialResult.BUSY)
    assert state.reachable is None  # BUSY tells nothing
    state.record(1.0, "a", DialResult.REFUSED, DialResult.REFUSED)
    assert state.reachable is False and state.data is False
    state.record(2.0, "b", DialResult.OK, DialResult.OK)
    assert state.reachable is True  # one successful dial from another host proves it
    state.record(3.0, "b", DialResult.OK, DialResult.FAILED)
    assert state.data is True and state.libp2p is False and state.reachable is False
    assert state.to_json(4.0)["answers"]["b"] == {"data": "ok", "libp2p": "failed", "s_ago": 1.0}
    state.expire(200.0, 180.0)  # both answers are older than three minutes
    assert state.reachable is None and state.to_json(200.0)["answers"] == {}

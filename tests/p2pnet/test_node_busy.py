"""`Node.set_busy`: while any role moves bulk data, both heartbeats slow down; they recover once none does."""

from types import SimpleNamespace

from p2pnet.core import SetTimer
from p2pnet.identity import Identity
from p2pnet.messages import Capacity
from p2pnet.node import Node
from p2pnet.peertable import TIMER_HEARTBEAT, LocalInfo, PeerTable, PeerTableConfig

ME = Identity.from_seed_text("me").peer_id
LOCAL = LocalInfo(("/ip4/127.0.0.1/tcp/1/p2p/me",), "127.0.0.1:9", ("relay",), Capacity(1, 2, 3))


def test_heartbeats_slow_while_any_role_is_busy():
    table = PeerTable(PeerTableConfig(heartbeat_interval_s=2.0, expiry_s=10.0, busy_heartbeat_factor=3.0), ME, LOCAL,
                      started_ms=1)
    gossip: list[float] = []
    commands: list = []
    runner = SimpleNamespace(core=table, command_soon=commands.append)
    node = SimpleNamespace(busy_with=set(), peertable=table, config=SimpleNamespace(gossip_heartbeat_s=1.0),
                           host=SimpleNamespace(set_gossip_heartbeat_s=gossip.append), _runners=[runner])
    Node.set_busy(node, "relay", True)
    Node.set_busy(node, "worker", True)  # already busy: nothing changes again
    assert table.busy and gossip == [3.0]
    assert table.on_timer(0.0, TIMER_HEARTBEAT)[-1].at == 10.0 / 3
    Node.set_busy(node, "relay", False)
    assert table.busy and gossip == [3.0]  # the worker still is
    Node.set_busy(node, "worker", False)
    assert not table.busy and gossip == [3.0, 1.0]
    # each change moved the peer table's pending heartbeat, inside its runner: none was sent before
    # the first, the last one (at 0.0) sets the next for 2.0 instead of 10 / 3
    assert [command(1.0) for command in commands] == [[], [SetTimer(2.0, TIMER_HEARTBEAT)]]
    assert table.on_timer(5.0, TIMER_HEARTBEAT)[-1].at == 7.0

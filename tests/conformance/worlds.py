"""Two worlds behind one test harness: real libp2p nodes in this process, or the simulator.

The conformance suite is written once against `World` and run in both: what holds for the
pure cores over real Noise/yamux/TCP must hold in virtual time, and the other way round.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import trio

from p2pnet.identity import Identity
from p2pnet.messages import Capacity
from p2pnet.node import Node, PeerConfig, run_node
from p2pnet.peertable import LocalInfo, PeerTable, PeerTableConfig
from simulations.engine import Engine
from simulations.world import NetworkModel, SimWorld

TABLE = PeerTableConfig(heartbeat_interval_s=0.25, expiry_s=1.5, reject_penalty=1.0, ban_score=-5.0)


class RealWorld:
    name = "real"

    def __init__(self, root: Path, nursery: trio.Nursery) -> None:
        self.root = root
        self.nursery = nursery
        self.nodes: dict[str, Node] = {}
        self.scopes: dict[str, trio.CancelScope] = {}

    def peer_id(self, name: str) -> str:
        return Identity.from_seed_text(name).peer_id

    async def add(self, name: str, bootstrap: str | None = None) -> None:
        config = PeerConfig(data_dir=self.root / name,
                            bootstrap=(self.nodes[bootstrap].host.addrs()[0],) if bootstrap else ())
        scope = trio.CancelScope()

        async def run(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await run_node(config, peertable_config=TABLE, identity=Identity.from_seed_text(name),
                               task_status=task_status)

        self.nodes[name] = await self.nursery.start(run)
        self.scopes[name] = scope

    async def stop(self, name: str) -> None:
        self.scopes.pop(name).cancel()
        del self.nodes[name]

    def table(self, name: str) -> PeerTable:
        return self.nodes[name].peertable

    async def send_frame(self, sender: str, to: str, frame: bytes) -> None:
        await self.nodes[sender].host.send_frame(self.peer_id(to), frame)

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> float:
        start = time.monotonic()
        with trio.fail_after(timeout_s):
            while not predicate():
                await trio.sleep(0.05)
        return time.monotonic() - start


class SimulatedWorld:
    name = "sim"

    def __init__(self, seed: int = 1) -> None:
        self.engine = Engine(seed)
        self.world = SimWorld(self.engine, NetworkModel(local_latency_s=0.002), sign=True)
        self.tables: dict[str, PeerTable] = {}

    def peer_id(self, name: str) -> str:
        return Identity.from_seed_text(name).peer_id

    async def add(self, name: str, bootstrap: str | None = None) -> None:
        identity = Identity.from_seed_text(name)
        local = LocalInfo((f"/sim/{name}/p2p/{identity.peer_id}",), f"sim:{name}", (), Capacity(1, 1, 1))
        table = PeerTable(TABLE, identity.peer_id, local, started_ms=int(self.engine.now * 1000))
        self.tables[name] = table
        self.world.add_peer(identity, [table])
        if bootstrap:
            self.world.connect(identity.peer_id, self.peer_id(bootstrap))

    async def stop(self, name: str) -> None:
        self.world.crash(self.peer_id(name))
        del self.tables[name]

    def table(self, name: str) -> PeerTable:
        return self.tables[name]

    async def send_frame(self, sender: str, to: str, frame: bytes) -> None:
        self.world.deliver_frame(self.peer_id(to), frame, via=self.peer_id(sender))

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> float:
        start = self.engine.now
        while not predicate():
            if self.engine.now - start > timeout_s:
                raise TimeoutError(f"condition not met within {timeout_s}s of virtual time")
            self.engine.run(until=self.engine.now + 0.05)
        await trio.lowlevel.checkpoint()
        return self.engine.now - start

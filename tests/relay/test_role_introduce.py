"""A relay fetching from a source that has not heard its heartbeat: the source's data plane refuses
it (`not_admitted`), the refused fetch introduces us (`Node.introduce`: the upstream's chunk
fetch, or the role's manifest fetch, whichever is refused first; either alone makes this pass,
neither fails it, measured by reverting each), and the next try is served, so the version
arrives. Without an introduction the source would refuse us until our next heartbeat reached it
(here never: see below), and after a few refusals the core would treat it as unreachable.

Two real relay peers in one trio run (libp2p, the data plane, the relay role). The source never
takes the fetcher's gossiped heartbeats (a gossip gate drops them, as a restart or lost
heartbeats would leave it), and the fetcher's heartbeats are 600 s apart. Every wait is on a
condition, under a deadline."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import trio

from p2pnet.identity import Identity
from p2pnet.messages import Heartbeat
from p2pnet.node import Node, PeerConfig, run_node
from p2pnet.peertable import PeerTableConfig

SOURCE = Identity.from_seed_text("introduce-relay-source")
FETCHER = Identity.from_seed_text("introduce-relay-fetcher")
SLOW = PeerTableConfig(heartbeat_interval_s=600.0, expiry_s=3000.0, max_interval_s=600.0)
DEADLINE_S = 120.0  # each wait; a loaded 2-core machine needs a few seconds, never this many
RELAY = {"chunk_bytes": 64 * 1024, "fsync": False, "announce_interval_s": 0.3}


async def test_a_fetch_from_a_source_that_had_not_heard_of_us_completes(tmp_path: Path) -> None:
    payload = tmp_path / "weights.bin"
    payload.write_bytes(os.urandom(300 * 1024))  # 5 chunks
    async with trio.open_nursery() as peers:
        source: Node = await peers.start(partial(
            run_node, PeerConfig(data_dir=tmp_path / "source", roles=("relay",)), sections={"relay": RELAY},
            identity=SOURCE))

        def lose_the_fetchers(frame: bytes) -> str | None:
            return "lost" if source.codec.precheck(frame)[1] == FETCHER.peer_id else None

        source.add_gossip_gate(Heartbeat.KIND, lose_the_fetchers)  # type: ignore[attr-defined]
        fetcher: Node = await peers.start(partial(
            run_node, PeerConfig(data_dir=tmp_path / "fetcher", roles=("relay",), bootstrap=(source.host.addrs()[0],)),
            sections={"relay": RELAY | {"trusted_publishers": [SOURCE.peer_id]}},
            peertable_config=SLOW, identity=FETCHER))
        with trio.fail_after(DEADLINE_S):
            assert await fetcher.wait_for_peers(lambda: fetcher.peertable.get(source.peer_id) is not None)
        assert source.peertable.get(fetcher.peer_id) is None

        await source.roles["relay"].publish([payload], "model", 1)
        with trio.fail_after(DEADLINE_S):
            await fetcher.roles["relay"]._until_held(1, None)
        assert source.dataplane.refused.get("not_admitted", 0) >= 1  # it refused us first
        assert source.peertable.get(fetcher.peer_id).seq == 1  # and knows us by our first heartbeat, sent directly
        files = fetcher.roles["relay"].store.version_files(1)
        assert [f.read_bytes() for f in files] == [payload.read_bytes()]
        peers.cancel_scope.cancel()

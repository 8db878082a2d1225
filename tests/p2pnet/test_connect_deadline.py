"""A dial has a deadline. py-libp2p's dial and security handshake have none, so an address that
accepts TCP and then says nothing held the dial for good, and with it one of the node's few
senders: eight such identities, each a fresh key, silenced a peer (a helper's repro, real hosts)."""

from __future__ import annotations

import socket

import pytest
import trio

from p2pnet.errors import PeerUnavailable
from p2pnet.host import open_host
from p2pnet.identity import Identity


async def test_a_dial_to_an_address_that_accepts_and_says_nothing_ends_at_its_deadline():
    other = Identity.generate().peer_id
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepted by the kernel, never answered
    try:
        async with open_host(Identity.generate(), "/ip4/127.0.0.1/tcp/0") as host:
            addr = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{other}"
            start = trio.current_time()
            with pytest.raises(PeerUnavailable, match="no connection within 0.5 s"):
                with trio.fail_after(60):  # (a hang fails the test rather than stalling it)
                    await host.connect(addr, other, timeout_s=0.5)
            assert trio.current_time() - start >= 0.5
    finally:
        silent.close()

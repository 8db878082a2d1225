"""Staying connected: dial the bootstrap peers until one answers, and again whenever we are alone.

A peer that starts before its bootstrap peer, or loses every connection (a network outage, a
restarted bootstrap host), must not stay alone for good. `keep_connected` runs for as long as
the peer runs: while the host has no connections it dials every bootstrap address and up to
`MAX_KNOWN_DIALS` peers from the peer table at once (any one is enough), waiting between rounds
with capped exponential backoff and full jitter (`Backoff`, pure, its randomness injected), and
goes back to a cheap check every `CHECK_S` once connected. Being alone is logged once as a
WARNING, each retry at DEBUG, the reconnection at INFO.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

import trio

from p2pnet.errors import ConfigError, PeerUnavailable

if TYPE_CHECKING:
    from p2pnet.node import Node

log = logging.getLogger(__name__)

CHECK_S = 2.0
DIAL_TIMEOUT_S = 10.0
MAX_KNOWN_DIALS = 8


class Backoff:
    """Delays for retries: doubling from `base_s` up to `cap_s`, each drawn uniformly from
    [delay/2, delay] so peers that lost the same bootstrap do not retry in lockstep."""

    def __init__(self, base_s: float, cap_s: float, rng: random.Random) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError("need 0 < base_s <= cap_s")
        self.base_s, self.cap_s, self._rng = base_s, cap_s, rng
        self._delay = base_s

    def next(self) -> float:
        delay = self._delay
        self._delay = min(self._delay * 2, self.cap_s)
        return self._rng.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._delay = self.base_s


def dial_targets(bootstrap: tuple[str, ...], known: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Addresses to dial when alone: every bootstrap address, then one address of each known
    peer (at most MAX_KNOWN_DIALS), skipping peers already named by a bootstrap address."""
    targets = list(bootstrap)
    named = {a.rsplit("/p2p/", 1)[-1] for a in bootstrap}
    for peer_id, addrs in known[:MAX_KNOWN_DIALS]:
        if peer_id not in named and addrs:
            targets.append(addrs[0])
    return targets


async def keep_connected(node: Node, bootstrap: tuple[str, ...], backoff: Backoff) -> None:
    alone_logged = False
    while True:
        if node.host.connected_peers():
            alone_logged = False
            backoff.reset()
            await trio.sleep(CHECK_S)
            continue
        known = [(e.peer_id, e.addrs) for e in node.peertable.peers() if e.reachable is not False]
        targets = dial_targets(bootstrap, known)
        if not targets:
            await trio.sleep(CHECK_S)  # nobody to dial yet: someone may dial us
            continue
        errors: list[str] = []
        async with trio.open_nursery() as nursery:
            for addr in targets:
                nursery.start_soon(_dial, node, addr, errors)
        if node.host.connected_peers():
            log.info("connected (%d of %d addresses answered)", len(targets) - len(errors), len(targets))
            continue
        delay = backoff.next()
        if not alone_logged:
            log.warning("no connections: none of %d bootstrap/known addresses answered (%s); "
                        "retrying with backoff up to %.0fs for as long as the peer runs",
                        len(targets), errors[0] if errors else "?", backoff.cap_s)
            alone_logged = True
        else:
            log.debug("still alone; next dial in %.1fs (%s)", delay, "; ".join(errors[:3]))
        await trio.sleep(delay)


async def _dial(node: Node, addr: str, errors: list[str]) -> None:
    with trio.move_on_after(DIAL_TIMEOUT_S):
        try:
            await node.host.connect(addr)
            return
        except (PeerUnavailable, ConfigError) as exc:
            errors.append(str(exc))
            return
    errors.append(f"{addr}: no answer within {DIAL_TIMEOUT_S}s")

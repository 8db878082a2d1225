"""The data plane's cached loads are exactly what summing the rates afresh gives.

`simulations.dataplane` shares uploads and downloads max-min fairly over the flows of the
resources whose flows changed; the other flows of the uploads and downloads those touch keep
their rates and count as load. Each port caches the sum of its uploads' and of its downloads'
rates until a rate changes or a flow comes or goes; a load kept past such a change would leave
a resource over- or under-used and change every result after it. This replays a broadcast with
churn (crashes, hangs), byzantine relays, window-limited connections, slow relays and capped
downloads, and before each sharing recomputes every cached load it may read and compares it bit for bit.
"""

from __future__ import annotations

import dataclasses

import simulations.hostile as hostile
from simulations.dataplane import RelayWorld
from simulations.models import Churn
from simulations.scenarios import broadcast


class _CheckedWorld(RelayWorld):
    checked = 0
    reused = 0

    def _share(self, flows, tag):  # type: ignore[no-untyped-def]
        """Before each sharing: every cached load it may read equals the sum of the rates, afresh."""
        ends = {(id(f.src), True): (f.src, True) for f in flows}
        ends.update({(id(f.dst), False): (f.dst, False) for f in flows})
        for port, up in ends.values():
            cached = port.up_load if up else port.down_load
            if cached >= 0.0:
                assert cached == sum([f.rate for f in (port.up if up else port.down)])
                _CheckedWorld.reused += 1
            _CheckedWorld.checked += 1
        super()._share(flows, tag)


def test_cached_loads_equal_fresh_sums_through_churn_and_capped_links(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(hostile, "RelayWorld", _CheckedWorld)
    churn = Churn(departures=0.2, end_s=1.0, leave_share=0, crash_share=1, hang_share=1)
    sc = dataclasses.replace(broadcast(80), checkpoint_bytes=100_000_000, chunk_bytes=4 * 2**20, seed=5,
                             byzantine=0.1, churn=churn, stall_timeout_s=2.0)
    assert sc.window_bytes != float("inf") and sc.download_ratio > 0 and sc.slow_fraction > 0
    s, _, run = hostile.run_broadcast(sc)
    assert isinstance(run.world, _CheckedWorld)
    assert s["survivors_right_checkpoint"] == s["survivors"] > 0
    assert sum(s["departed"].values()) > 0
    assert _CheckedWorld.reused > 1000 and _CheckedWorld.checked > _CheckedWorld.reused  # the cache was used, and refilled

"""The data plane's cached upload shares are exactly what sharing the upload afresh gives.

`simulations.dataplane` water-fills a source's upload over its flows once per change of its
flows and reuses the shares while a sink's downloads are re-rated; a share kept past a change
would move bytes at a stale rate and change every result after it. This replays a broadcast with
churn (crashes, hangs), byzantine relays, window-limited connections and capped downloads, and at
every re-rating recomputes the shares of each source involved and compares them bit for bit.
"""

from __future__ import annotations

import dataclasses

import simulations.hostile as hostile
from simulations.dataplane import RelayWorld, _water_fill
from simulations.models import Churn
from simulations.scenarios import broadcast


class _CheckedWorld(RelayWorld):
    checked = 0
    reused = 0

    def _rerate(self, flows):  # type: ignore[no-untyped-def]
        for port in {id(f.src): f.src for f in flows}.values():
            if port.shared:
                cached = [f.share for f in port.up]
                _water_fill(port)
                assert [f.share for f in port.up] == cached
                _CheckedWorld.reused += 1
            _CheckedWorld.checked += 1
        super()._rerate(flows)


def test_cached_upload_shares_equal_fresh_ones_through_churn_and_capped_links(monkeypatch) -> None:  # type: ignore[no-untyped-def]
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

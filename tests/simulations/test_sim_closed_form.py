"""The simulator against closed forms: a pipelined chain and k-ary trees within 5%."""

from __future__ import annotations

import dataclasses

import pytest

from simulations.closed_form import (catch_probability, chain_time_s, expected_accepted_forgeries, star_time_s,
                                     tree_depth, tree_time_s)
from simulations.models import GBIT, Bandwidth
from simulations.run import run_scenario
from simulations.scenarios import chain, kary_tree


def test_tree_depth() -> None:
    assert [tree_depth(n, 1) for n in (1, 5)] == [1, 5]
    assert [tree_depth(n, 2) for n in (1, 2, 3, 6, 7, 14, 15)] == [1, 1, 2, 2, 3, 3, 4]
    assert tree_depth(120, 3) == 4 and tree_depth(84, 4) == 3


@pytest.mark.parametrize("peers", [5, 30])
def test_pipelined_chain_matches_closed_form(peers: int) -> None:
    sc = chain(peers)
    s = run_scenario(sc).summary
    closed = chain_time_s(peers, s["chunks"], s["chunk_bytes"], sc.upload.low_bps, sc.local_latency_s)
    assert s["time_to_all_s"] == pytest.approx(closed, rel=0.05)
    # and the pipelining matters: store-and-forward of the whole file would take N*S/U
    assert s["time_to_all_s"] < 0.5 * peers * sc.checkpoint_bytes / sc.upload.low_bps


@pytest.mark.parametrize(("fanout", "peers"), [(2, 30), (3, 40), (4, 84)])
def test_pipelined_kary_tree_matches_closed_form(fanout: int, peers: int) -> None:
    sc = kary_tree(peers, fanout=fanout)
    s = run_scenario(sc).summary
    closed = tree_time_s(peers, s["chunks"], s["chunk_bytes"], sc.upload.low_bps, fanout, sc.local_latency_s)
    assert s["time_to_all_s"] == pytest.approx(closed, rel=0.05)


def test_star_matches_n_s_over_u() -> None:
    sc = dataclasses.replace(chain(12), strategy="star", checkpoint_bytes=16 * 2**24,
                             upload=Bandwidth.fixed(GBIT))
    s = run_scenario(sc).summary
    assert s["time_to_all_s"] == pytest.approx(star_time_s(12, sc.checkpoint_bytes, sc.origin_upload_bps), rel=0.05)


def test_audit_closed_forms() -> None:
    assert catch_probability(0.1, 1.0, 1) == pytest.approx(0.1)
    assert catch_probability(0.1, 0.5, 10) == pytest.approx(1 - 0.95**10)
    q, k = 0.2, 12
    # ban after the first failure: sum over j of P(no failure in the first j) = (1-q)(1-(1-q)^k)/q
    assert expected_accepted_forgeries(0.2, 1.0, k, 1) == pytest.approx((1 - q) * (1 - (1 - q) ** k) / q)
    # never banned within the horizon: every uncaught batch counts
    assert expected_accepted_forgeries(0.2, 1.0, k, k + 1) == pytest.approx(k * (1 - q))
    assert expected_accepted_forgeries(1.0, 1.0, k, 1) == 0.0
    assert expected_accepted_forgeries(0.0, 1.0, k, 1) == k

"""Models and scenario configs: seeded, validated, overridable by name."""

from __future__ import annotations

import math
import random

import pytest

from p2pnet.errors import ConfigError
from simulations.inference_wait import rl_loop, steady_period_s
from simulations.models import CRASH, HANG, JOIN, LEAVE, MBIT, Bandwidth, Churn, Partition, RegionMix, network_model
from simulations.scenarios import SCENARIOS, BroadcastScenario, scenario, to_jsonable, with_params


def test_bandwidth_draws_stay_in_range_and_are_seeded() -> None:
    bw = Bandwidth()
    draws = [bw.draw(random.Random(1)) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    many = [bw.draw(random.Random(i)) for i in range(2000)]
    assert min(many) >= 100 * MBIT and max(many) <= 10_000 * MBIT
    assert sum(many) / len(many) == pytest.approx(bw.mean(), rel=0.1)
    assert Bandwidth.fixed(5.0).draw(random.Random(0)) == 5.0
    tiers = Bandwidth("tiers", 1.0, 9.0, 0.25)
    assert {tiers.draw(random.Random(i)) for i in range(50)} == {1.0, 9.0} and tiers.mean() == 3.0
    with pytest.raises(ConfigError):
        Bandwidth("pareto")
    with pytest.raises(ConfigError):
        Bandwidth("log_uniform", 10.0, 1.0)


def test_churn_draws_are_sorted_seeded_and_never_repeat_a_peer() -> None:
    churn = Churn(departures=0.3, joins=0.1, start_s=1.0, end_s=5.0)
    events = churn.draw(random.Random(7), 1000)
    assert events == churn.draw(random.Random(7), 1000) != churn.draw(random.Random(8), 1000)
    assert events == sorted(events) and all(1.0 <= e.at_s <= 5.0 for e in events)
    leaving = [e.peer for e in events if e.kind != JOIN]
    assert len(leaving) == len(set(leaving)) and 230 < len(leaving) < 370
    assert {e.kind for e in events} == {LEAVE, CRASH, HANG, JOIN}
    assert sorted(e.peer for e in events if e.kind == JOIN) == list(range(1000, 1000 + sum(
        1 for e in events if e.kind == JOIN)))
    assert Churn().draw(random.Random(0), 100) == []


def test_regions_and_partitions() -> None:
    regions = RegionMix(1, 0, 1).assign(random.Random(0), 200)
    assert set(regions) == {"us", "asia"}
    model = network_model()
    assert model.latency("us", "eu") == model.latency("eu", "us") == 0.040 and model.latency("eu", "eu") == 0.005
    assert Partition(region="asia").cut_off(random.Random(0), regions) == [i for i, r in enumerate(regions)
                                                                          if r == "asia"]
    assert len(Partition(fraction=0.25).cut_off(random.Random(0), regions)) == 50
    assert not Partition().active
    with pytest.raises(ConfigError):
        Partition(region="mars")


def test_every_named_scenario_builds_and_overrides_parse() -> None:
    for name in SCENARIOS:
        config = scenario(name, 10, 3)
        assert config.seed == 3 and to_jsonable(config)
    sc = with_params(scenario("churn"), {"churn.departures": "0.05", "peers": "1e3", "forge": "yes",
                                         "strategy": "tree4"})
    assert (sc.churn.departures, sc.peers, sc.forge, sc.strategy) == (0.05, 1000, True, "tree4")
    assert to_jsonable(sc)["download"]["low_bps"] == "inf"
    with pytest.raises(ConfigError):
        with_params(sc, {"churn.nope": "1"})
    with pytest.raises(ConfigError):
        with_params(sc, {"peers": "many"})
    with pytest.raises(ConfigError):
        with_params(sc, {"strategy": "gossip"})  # validated on construction
    with pytest.raises(ConfigError):
        scenario("nonesuch")
    with pytest.raises(ConfigError):
        BroadcastScenario(peers=0)


def test_rl_loop_async_levels() -> None:
    # infinite bandwidth: async >= 1 runs at max(generate, train); async 0 waits for every train step
    rows = rl_loop((0.0, 0.0), 1, generate_s=90.0, train_step_s=60.0, steps=10)
    published = [r["published_s"] for r in rows]
    assert [b - a for a, b in zip(published[1:], published[2:])] == [90.0] * 8  # one step per generate_s
    assert all(r["inference_wait_mean_s"] == 0.0 for r in rows)
    sync = rl_loop((10.0, 20.0), 0, generate_s=90.0, train_step_s=60.0, steps=5)
    assert [r["inference_wait_max_s"] for r in sync[1:]] == [80.0] * 4  # train + the slower broadcast
    assert sync[1]["inference_wait_mean_s"] == 75.0  # then the fast worker also waits for the slow one's batch
    assert sync[4]["inference_wait_mean_s"] == 80.0
    slow = rl_loop((500.0,), 2, generate_s=90.0, train_step_s=60.0, steps=20)
    # a broadcast longer than async_level steps: one step every (broadcast + generate + train) / (async + 1)
    assert sum(r["inference_wait_mean_s"] for r in slow[-3:]) / 3 == pytest.approx(650 / 3 - 90)
    assert math.isfinite(slow[-1]["published_s"])


@pytest.mark.parametrize("async_level", [0, 1, 2, 4])
@pytest.mark.parametrize("delay_s", [5.0, 60.0, 200.0, 700.0])
def test_rl_loop_reaches_the_steady_period(async_level: int, delay_s: float) -> None:
    rows = rl_loop((delay_s / 2, delay_s), async_level, generate_s=90.0, train_step_s=60.0, steps=60)
    cycle = async_level + 1  # the loop may settle into bursts of async_level + 1 steps
    period = (rows[-1]["published_s"] - rows[-1 - 4 * cycle]["published_s"]) / (4 * cycle)
    expected = steady_period_s(delay_s, async_level, 90.0, 60.0)
    assert period == pytest.approx(expected)
    waits = [r["inference_wait_max_s"] for r in rows[-4 * cycle:]]
    assert sum(waits) / len(waits) == pytest.approx(expected - 90.0)

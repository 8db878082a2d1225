"""Counters only grow: Prometheus reads a counter that goes down as a restart, and `rate()` then
counts the whole total again. Bytes by the other peer's role are added as they move (a peer that
leaves the peer table keeps its bytes under the role it had); trainer batches are counted as
they are accepted (a later verdict that rejects one adds to `rejected`, takes nothing back)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.core import Metric

from p2pnet.identity import Identity
from relay.metrics import BytesByRole, RelayMetrics
from tests.trainer.test_intake import WORKER, Entry, make, submit, verdict
from trainer.metrics import TrainerMetrics


def _totals(families, name: str) -> dict[str, float]:
    family: Metric = next(f for f in families if f.name == name)
    return {next(iter(s.labels.values())): s.value for s in family.samples if s.name.endswith("_total")}


def test_relay_bytes_by_role_stay_with_the_role_a_departed_peer_had():
    table = {"A": SimpleNamespace(roles=("worker", "relay")), "B": SimpleNamespace(roles=("validator", "relay"))}
    node = SimpleNamespace(peertable=SimpleNamespace(get=table.get))
    moved = BytesByRole(node)
    role = SimpleNamespace(bytes_by_role=moved, chunk_checks={"verified": 0, "rejected": 0},
                           core=SimpleNamespace(complete_versions=lambda: []), timeline={},
                           store=SimpleNamespace(used_bytes=0), _upload=SimpleNamespace(rate_bps=1.0))

    def scrape():
        families = list(RelayMetrics(node).collect(role))
        return _totals(families, "p2pnet_relay_bytes_served"), _totals(families, "p2pnet_relay_bytes_received")

    moved.add(moved.served, "A", 5_000_000_000)
    moved.add(moved.fetched, "B", 7)
    assert scrape() == ({"worker": 5e9}, {"validator": 7})
    del table["A"]  # A's heartbeats stop: it leaves the peer table
    moved.add(moved.served, "A", 1)  # a last chunk to it, after
    moved.add(moved.served, "B", 10)
    assert scrape() == ({"worker": 5e9, "unknown": 1, "validator": 10}, {"validator": 7})


def test_trainer_batch_counters_do_not_go_down_when_a_verdict_reverses():
    intake = make()
    role = SimpleNamespace(history=[], version=0, config=SimpleNamespace(steps=5), intake=intake,
                           publish_timing={}, propagation_s=lambda version: None)
    _, sid = submit(intake, WORKER, 0, now=1.0)
    verdict(intake, sid, WORKER, 0, True, now=2.0)
    assert _totals(TrainerMetrics(None).collect(role), "p2pnet_trainer_batches") == \
        {"accepted": 1, "rejected": 0, "trained": 0}
    other = Identity.from_seed_text("val2")
    intake.membership.directory.entries[other.peer_id] = Entry(other.peer_id, ("validator",))
    verdict(intake, sid, WORKER, 0, False, sender=other, now=3.0)  # a second validator fails it
    assert _totals(TrainerMetrics(None).collect(role), "p2pnet_trainer_batches") == \
        {"accepted": 1, "rejected": 1, "trained": 0}
    assert intake.admissible(4.0, 0) == []  # (it is out of training all the same)

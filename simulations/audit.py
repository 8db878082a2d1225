"""The audit experiment: sampled validators against workers that forge proofs, in virtual time.

`run_audit(scenario)` builds `validators` peers, each running the real peer table
(`p2pnet.peertable.PeerTable`, through which validators count each other) and the real
`verify.validator.ValidatorCore` wrapped in `InlineChecking`, and `cheaters + honest` worker
peers that publish signed-shaped `Submission`s on the submissions topic. Everything a real
validator does happens: tickets (`verify.assign`), claims, the lowest claim checking, verdicts
gossiped and admitted by the others, reputation and bans (`verify.reputation`).

The one stand-in is the checker: instead of recomputing TOPLOC proofs with a model, it knows
which submissions are forged (a marker byte in the proof) and detects a forged one with
probability `detection_rate`, decided by a hash of the submission id (so two validators
checking the same submission agree, as a recomputation would). Honest submissions pass.

Outcome per cheater: which of its submissions were caught, whether it was banned, and how
many forged batches were accepted (neither caught nor refused). `closed_form` predicts
P(caught within k) = 1-(1-rate*detection)^k and the expected accepted forgeries.
"""

from __future__ import annotations

import random
import time
from typing import Any

import blake3

from p2pnet.core import Publish, SetTimer
from p2pnet.identity import Identity
from p2pnet.messages import Capacity
from p2pnet.peertable import LocalInfo, PeerTable, PeerTableConfig
from simulations.closed_form import catch_probability, expected_accepted_forgeries
from simulations.engine import Engine
from simulations.models import network_model
from simulations.scenarios import AuditScenario
from simulations.world import SimWorld
from verify.messages import SUBMISSIONS_TOPIC, Submission, rollout_record
from verify.reputation import WorkerBanned
from verify.validator import CheckRequested, InlineChecking, ValidatorCore, ValidatorCoreConfig, VerdictPublished

FORGED, GENUINE = 0x00, 0x01
HEARTBEATS_SETTLE_S = 5.0  # validators learn each other (their n) before the first submission
_IDENTITIES: dict[str, Identity] = {}


def _identity(name: str) -> Identity:
    found = _IDENTITIES.get(name)
    if found is None:
        found = _IDENTITIES[name] = Identity.from_seed_text(name)
    return found


class SubmittingWorker:
    """A worker core that publishes `count` submissions, one every `every_s` from `start_s`.
    A cheater's proofs are forged (marked). Publishes only: workers need no inputs here."""

    topics: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()

    def __init__(self, count: int, *, forged: bool, start_s: float, every_s: float, rng: random.Random) -> None:
        self.count, self.forged, self.start_s, self.every_s = count, forged, start_s, every_s
        self.rng = rng
        self.sent = 0

    def start(self, now: float) -> list[Any]:
        return [SetTimer(self.start_s, "worker/next")]

    def on_timer(self, now: float, key: str) -> list[Any]:
        sub = make_submission(self.sent, self.rng.randbytes(16), forged=self.forged)
        self.sent += 1
        more = [SetTimer(now + self.every_s, "worker/next")] if self.sent < self.count else []
        return [Publish(SUBMISSIONS_TOPIC, sub), *more]

    def on_message(self, now: float, envelope: Any) -> list[Any]:
        return []

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Any]:
        return []


def make_submission(step: int, nonce: bytes, *, forged: bool) -> Submission:
    proof = bytes([FORGED if forged else GENUINE]) * 258
    rollouts = tuple(rollout_record(prompt_ids=[1, 5, 6], output_ids=[7, 8, 2], logprobs=[-0.5, -1.0, -0.1],
                                    proofs=[proof], stop_reason="eos", row=r) for r in range(4))
    return Submission(model="sim", model_version=0, step=step, seed=step, task_seed=7, prompts_per_submission=2,
                      group_size=2, temperature=1.0, max_new_tokens=8, rollouts=rollouts, nonce=nonce)


def detection_checker(detection_rate: float, salt: int):
    """A checker that fails a forged submission with probability `detection_rate`."""
    threshold = int(detection_rate * 2**64)

    def check(request: CheckRequested) -> tuple[bool, tuple[str, ...]]:
        forged = request.submission.rollouts[0].proofs[0][0] == FORGED
        if not forged:
            return True, ()
        draw = int.from_bytes(blake3.blake3(b"detect/%d/" % salt + request.submission_id).digest(8), "big")
        return (False, ("row0:toploc_exp",)) if draw < threshold else (True, ())

    return check


def run_audit(sc: AuditScenario) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run `sc`: (summary for results.json, one row per worker)."""
    wall = time.perf_counter()
    rng = random.Random(sc.seed)
    engine = Engine(sc.seed)
    world = SimWorld(engine, network_model(), sign=False)
    validators = [_identity(f"sim/validator-{i}") for i in range(sc.validators)]
    cheaters = [_identity(f"sim/cheater-{sc.seed}-{i}") for i in range(sc.cheaters)]
    honest = [_identity(f"sim/worker-{sc.seed}-{i}") for i in range(sc.honest)]
    workers = cheaters + honest
    config = ValidatorCoreConfig(sample_rate=sc.sample_rate, claim_window_s=sc.claim_window_s,
                                 takeover_after_s=60.0, workers=tuple(sorted(w.peer_id for w in workers)),
                                 validators=tuple(sorted(v.peer_id for v in validators)),
                                 ban_after_failures=sc.ban_after_failures, max_queue=1024)
    checker = detection_checker(sc.detection_rate, sc.seed)
    cores = {}
    for number, v in enumerate(validators):
        local = LocalInfo(addrs=(f"/sim/v{number}",), data_addr="", roles=("validator",), capacity=Capacity(0, 0, 0))
        table = PeerTable(PeerTableConfig(), v.peer_id, local, started_ms=0)
        core = ValidatorCore(config, v, table)
        cores[v.peer_id] = core
        world.add_peer(v, [table, InlineChecking(core, checker, check_s=sc.check_s)], region=_region(number))
    for number, w in enumerate(workers):
        start_s = HEARTBEATS_SETTLE_S + sc.submit_every_s * number / max(1, len(workers))
        worker = SubmittingWorker(sc.submissions, forged=w in cheaters, start_s=start_s, every_s=sc.submit_every_s,
                                  rng=random.Random(rng.getrandbits(64)))
        world.add_peer(w, [worker], region=_region(number))
    for a in validators:
        for b in validators + workers:
            world.connect(a.peer_id, b.peer_id)

    verdicts: dict[tuple[str, int], list[bool]] = {}
    banned_at: dict[str, float] = {}

    def listen(now: float, peer: str, event: object) -> None:
        if isinstance(event, VerdictPublished):
            v = event.verdict
            verdicts.setdefault((v.worker, v.step), []).append(v.accepted)
        elif isinstance(event, WorkerBanned):
            banned_at.setdefault(event.worker, now)

    world.listeners.append(listen)
    end_s = HEARTBEATS_SETTLE_S + sc.submit_every_s * (sc.submissions + 1) + sc.claim_window_s + sc.check_s
    engine.run(until=end_s)

    rows = []
    for w in workers:
        outcomes = []
        for step in range(sc.submissions):
            got = verdicts.get((w.peer_id, step))
            outcomes.append("unchecked" if got is None else "caught" if not all(got) else "passed")
        first = next((i for i, o in enumerate(outcomes) if o == "caught"), None)
        after_ban = _refused_steps(outcomes, sc.ban_after_failures)
        accepted = sum(1 for i, o in enumerate(outcomes) if o != "caught" and i not in after_ban)
        rows.append({
            "worker": w.peer_id,
            "cheater": w in cheaters,
            "checked": sum(1 for o in outcomes if o != "unchecked"),
            "caught": sum(1 for o in outcomes if o == "caught"),
            "first_caught": first,
            "banned_s": None if w.peer_id not in banned_at else round(banned_at[w.peer_id], 6),
            "accepted": accepted,
            "outcomes": "".join(o[0] for o in outcomes),
        })
    return _summary(sc, rows, cores, engine, time.perf_counter() - wall), rows


def _refused_steps(outcomes: list[str], ban_after: int) -> set[int]:
    """Steps submitted after the worker's ban took effect (they are refused, and never checked)."""
    caught = 0
    for i, outcome in enumerate(outcomes):
        if outcome == "caught":
            caught += 1
            if caught >= ban_after:
                return set(range(i + 1, len(outcomes)))
    return set()


def _region(number: int) -> str:
    return ("us", "eu", "asia")[number % 3]


def _summary(sc: AuditScenario, rows: list[dict[str, Any]], cores: dict[str, ValidatorCore], engine: Engine,
             wall_s: float) -> dict[str, Any]:
    cheats = [r for r in rows if r["cheater"]]
    honest = [r for r in rows if not r["cheater"]]
    k_max = sc.submissions
    observed = [sum(1 for r in cheats if r["first_caught"] is not None and r["first_caught"] < k) / max(1, len(cheats))
                for k in range(1, k_max + 1)]
    predicted = [catch_probability(sc.sample_rate, sc.detection_rate, k) for k in range(1, k_max + 1)]
    mean_accepted = sum(r["accepted"] for r in cheats) / max(1, len(cheats))
    expected = expected_accepted_forgeries(sc.sample_rate, sc.detection_rate, k_max, sc.ban_after_failures)
    submissions = sum(c.stats["seen"] for c in cores.values()) / max(1, len(cores))
    checks = sum(c.stats["checked"] for c in cores.values())
    return {
        "scenario": sc.name,
        "seed": sc.seed,
        "validators": sc.validators,
        "cheaters": sc.cheaters,
        "honest": sc.honest,
        "submissions_per_worker": k_max,
        "sample_rate": sc.sample_rate,
        "detection_rate": sc.detection_rate,
        "ban_after_failures": sc.ban_after_failures,
        "p_caught_within_k": [round(x, 6) for x in observed],
        "p_caught_within_k_closed_form": [round(x, 6) for x in predicted],
        "p_caught_max_abs_error": round(max(abs(a - b) for a, b in zip(observed, predicted)), 6),
        "cheaters_banned": sum(1 for r in cheats if r["banned_s"] is not None),
        "honest_banned": sum(1 for r in honest if r["banned_s"] is not None),
        "honest_caught": sum(r["caught"] for r in honest),
        "mean_accepted_forgeries": round(mean_accepted, 6),
        "expected_accepted_forgeries": round(expected, 6),
        "cheater_expected_gain": round(mean_accepted * sc.gain_per_batch, 6),
        "cheater_expected_gain_closed_form": round(expected * sc.gain_per_batch, 6),
        "checks_per_submission": round(checks / submissions, 6) if submissions else None,
        "submissions_seen": round(submissions, 3),
        "takeovers": sum(c.stats["takeovers"] for c in cores.values()),
        "events": engine.events_run,
        "wall_s": round(wall_s, 3),
    }

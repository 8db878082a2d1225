"""Answering a restarted trainer: what a worker or validator sent that the trainer may have missed.

Workers submit one batch per step and then wait for the next version; validators check each
batch once and refuse a worker's second submission for a step. So a batch, claim or verdict the
trainer did not hear (published while it was down, or after its last save: `trainer.intake_state`)
is never sent again, and a trainer whose step lacks every batch waits while every worker waits for
it. A restarted trainer therefore sends each worker and validator it meets a `Recall(since_step)`
(`trainer.recall`), and they answer directly: a worker with its submission frames for steps >=
`since_step`, exactly as first published (`Recalled`: the id validators' verdicts name is the
hash of that payload), a validator with its claims and verdicts for those steps, signed again
(a verdict's meaning is its body; its ticket inside it proves the draw).

`RecallAnswers` keeps what was sent, by step, per worker it is about: the newest `per_worker`
entries of each of the `workers` workers heard from last, so one worker's burst (say, claims
on batches for made-up future steps) pushes out only its own. It answers a `Recall` only from a
peer in `trusted` (the trusted publishers of the peer's relay: the trainer's key), at most once
per `interval_s` per asker, and with at most `MAX_ANSWER` bodies (the workers heard from last first): a
64-byte request must not buy megabytes at will, nor fill the node's outbox (4096 effects). With
no trusted peers configured nothing is answered. `RecallCore` runs it for a worker; the
validator's core holds one of its own (`verify.validator`).

A pure module (p2pnet.core contract): time comes in as `now`.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from typing import Any, Collection

from p2pnet.core import Effect, ReactiveCore, Send
from p2pnet.wire import Envelope
from verify.messages import Recall

RECALL_INTERVAL_S = 30.0  # one answer per asker this often at most
WORKER_KEPT = 8  # a worker's own submission frames kept (one per step; the async window is a few)
VALIDATOR_KEPT = 8  # a validator's claims and verdicts kept per worker (a claim and a verdict a step)
VALIDATOR_WORKERS = 4096  # the workers a validator keeps them for, heard from last
MAX_ANSWER = 1024  # bodies in one answer at most


class RecallAnswers:
    def __init__(self, trusted: Collection[str], *, per_worker: int, workers: int = 1,
                 interval_s: float = RECALL_INTERVAL_S) -> None:
        self.trusted = frozenset(trusted)
        self.per_worker = per_worker
        self.workers = workers
        self.interval_s = interval_s
        # worker -> its (step, body), oldest first; workers heard from last at the end
        self._sent: OrderedDict[str, deque[tuple[int, Any]]] = OrderedDict()
        self._answered: dict[str, float] = {}  # asker -> when we last answered it
        self.stats = {"answered": 0, "refused_untrusted": 0, "refused_too_soon": 0, "sent": 0}

    def sent(self, worker: str, step: int, body: Any) -> None:
        """We published `body` (a `Recalled` frame, a claim, a verdict) on `worker`'s batch for `step`."""
        kept = self._sent.pop(worker, None)
        if kept is None:
            kept = deque(maxlen=self.per_worker)
            if len(self._sent) >= self.workers:
                self._sent.popitem(last=False)
        kept.append((step, body))
        self._sent[worker] = kept

    def answer(self, now: float, envelope: Envelope[Any]) -> list[Effect]:
        """The bodies for a `Recall` from `envelope`'s sender, as direct `Send`s to it."""
        asker, recall = envelope.sender, envelope.body
        if not isinstance(recall, Recall):
            return []
        if asker not in self.trusted:
            self.stats["refused_untrusted"] += 1
            return []
        if now - self._answered.get(asker, -math.inf) < self.interval_s:
            self.stats["refused_too_soon"] += 1
            return []
        self._answered[asker] = now  # askers are trusted peers only: a handful
        wanted = (body for kept in reversed(self._sent.values()) for step, body in kept if step >= recall.since_step)
        effects: list[Effect] = [Send(asker, body) for body in itertools.islice(wanted, MAX_ANSWER)]
        self.stats["answered"] += 1
        self.stats["sent"] += len(effects)
        return effects


class RecallCore(ReactiveCore):
    """A worker's answers to a restarted trainer: run by the worker role (`Node.run_core`)."""

    kinds = (Recall.KIND,)  # type: ignore[attr-defined]

    def __init__(self, trusted: Collection[str], *, kept: int = WORKER_KEPT) -> None:
        self.answers = RecallAnswers(trusted, per_worker=kept)

    def on_message(self, now: float, envelope: Envelope[Any]) -> list[Effect]:
        return self.answers.answer(now, envelope)

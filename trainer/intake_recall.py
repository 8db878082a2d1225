"""What the intake takes in from a `Recall`'s answers (`verify.recall`): workers' submission frames
sent again as first published, and validators' claims and verdicts, which may come first.

A `Recalled` frame is a worker's own submission, signed when it was first published and perhaps
long ago: its signature is checked (`recalled_submission`), its age is not (the codec would drop
anything older than `max_age_s`), and it must be the answering worker's own. The intake then
takes it as any submission, marked skewed (it is far from its timestamp), so it is trained on
only with an accepting verdict of its own, never unchecked: a worker cannot use a recall to slip
in a batch the validators refused without a claim.

Answers cross: a validator's verdict on a batch the trainer has not heard yet (the worker's
answer is still on its way) would be dropped as `unknown_submission`. `EarlyVerdicts` keeps such
verdicts from admitted validators, at most `EARLY_KEPT` (`EARLY_PER_SENDER` from one validator,
so one cannot push out the others'), each for `EARLY_S`, and hands them back when their
submission arrives. Gossip may race the same way, and is served alike. Claims are not kept: a
recalled batch is trained only with a verdict anyway, so a claim on it changes nothing.

A pure module: time comes in as `now`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from p2pnet.errors import MessageRejected
from p2pnet.wire import Codec, Envelope
from verify.messages import Recalled, Submission

EARLY_KEPT = 4096  # verdicts kept for submissions not heard yet
EARLY_PER_SENDER = 1024  # of them from one validator
EARLY_S = 120.0  # each kept this long at most

_ANY_AGE = Codec(None, max_age_s=math.inf, max_future_s=math.inf)  # checks signatures only


def signed_submission(frame: bytes, sender: str) -> Envelope[Any] | None:
    """The envelope of `frame` if it is a `Submission` signed by `sender`, whatever its age (not
    checked, nor measured: `age_s` None), else None: a recalled frame, or a worker's own frame
    read back from its disk (`trainer.worker_frames`)."""
    try:
        envelope = _ANY_AGE.decode(frame, 0.0)
    except MessageRejected:
        return None
    if not isinstance(envelope.body, Submission) or envelope.sender != sender:
        return None
    return replace(envelope, age_s=None)


def recalled_submission(envelope: Envelope[Any]) -> Envelope[Any] | None:
    """The submission in a `Recalled` envelope, signed by the envelope's sender (`signed_submission`;
    the intake marks it skewed itself), or None if it is not one."""
    body = envelope.body
    return signed_submission(body.frame, envelope.sender) if isinstance(body, Recalled) else None


class EarlyVerdicts:
    def __init__(self, *, kept: int = EARLY_KEPT, per_sender: int = EARLY_PER_SENDER, keep_s: float = EARLY_S) -> None:
        self.kept = kept
        self.per_sender = per_sender
        self.keep_s = keep_s
        self._by_sid: OrderedDict[bytes, list[tuple[float, Envelope[Any]]]] = OrderedDict()  # oldest first
        self._count = 0
        self._senders: dict[str, int] = {}  # sender -> its verdicts kept

    def park(self, now: float, sid: bytes, envelope: Envelope[Any]) -> None:
        self._expire(now)
        if self._senders.get(envelope.sender, 0) >= self.per_sender:
            return  # its share is full: the others' stay
        if self._count >= self.kept:
            _, dropped = self._by_sid.popitem(last=False)
            self._forget(dropped)
        self._by_sid.setdefault(sid, []).append((now, envelope))
        self._count += 1
        self._senders[envelope.sender] = self._senders.get(envelope.sender, 0) + 1

    def take(self, now: float, sid: bytes) -> list[Envelope[Any]]:
        """The verdicts kept for `sid`, in arrival order (they are forgotten here)."""
        self._expire(now)
        parked = self._by_sid.pop(sid, [])
        self._forget(parked)
        return [envelope for _, envelope in parked]

    def _forget(self, parked: list[tuple[float, Envelope[Any]]]) -> None:
        self._count -= len(parked)
        for _, envelope in parked:
            left = self._senders[envelope.sender] - 1
            if left:
                self._senders[envelope.sender] = left
            else:
                del self._senders[envelope.sender]

    def __len__(self) -> int:
        return self._count

    def _expire(self, now: float) -> None:
        while self._by_sid:
            sid, parked = next(iter(self._by_sid.items()))
            if parked[0][0] >= now - self.keep_s:
                break
            del self._by_sid[sid]
            self._forget(parked)

"""Network-wide notices: a signed one-line announcement every peer records with its arrival time.

`p2pnet peer announce TEXT` publishes one; `peer status` lists the last ones received, with
the latency from the sender's timestamp. Operators use it as a network-wide ping; the gossip
benchmark uses it to measure delivery ratio and latency. A pure core: it only records.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from p2pnet.core import Effect, Publish, ReactiveCore
from p2pnet.wire import Envelope, message

NOTICE_TOPIC = "p2pnet/v1/notices"
KEEP_NOTICES = 256


@message("notice", max_bytes=2048)
@dataclass(frozen=True, slots=True)
class Notice:
    notice_id: str
    text: str

    def __post_init__(self) -> None:
        # in UTF-8 bytes, as the frame counts them: 1,024 characters of "€" were 3 KB, passed this and
        # failed the frame's limit at the send, stopping the peer
        if not 0 < len(self.notice_id.encode()) <= 64 or len(self.text.encode()) > 1024:
            raise ValueError("notice_id must be 1-64 bytes and text at most 1024 bytes (UTF-8)")


@dataclass(frozen=True)
class Received:
    notice_id: str
    sender: str
    text: str
    sent_ms: int
    received_ms: int


class Notices(ReactiveCore):
    topics = (NOTICE_TOPIC,)
    kinds = (Notice.KIND,)  # type: ignore[attr-defined]

    def __init__(self, wall_ms: Any) -> None:
        self._wall_ms = wall_ms  # injected wall clock: received times are compared to senders' stamps
        self.received: deque[Received] = deque(maxlen=KEEP_NOTICES)

    def on_message(self, now: float, envelope: Envelope[Any]) -> list[Effect]:
        notice = envelope.body
        self.received.append(Received(notice.notice_id, envelope.sender, notice.text, envelope.ts_ms, self._wall_ms()))
        return []

    def announce(self, notice_id: str, text: str) -> list[Effect]:
        return [Publish(NOTICE_TOPIC, Notice(notice_id, text))]

    def to_json(self) -> list[dict[str, Any]]:
        return [{"notice_id": r.notice_id, "sender": r.sender, "text": r.text, "sent_ms": r.sent_ms,
                 "received_ms": r.received_ms, "latency_ms": r.received_ms - r.sent_ms} for r in self.received]

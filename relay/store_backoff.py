"""When to try a full or failing store again: `StoreBackoff`, pure (times are passed in), and
`StoreTrouble`, which of the two started its hold.

The relay role (`relay.role`) holds its fetching while the store is full (the budget or the
disk: `StoreFull`, ENOSPC, EDQUOT) or failing (EIO and the like from a write or an fsync), and
probes it again when a hold ends; the holds grow while the store stays full or failing. This
module knows nothing of the store itself and does no I/O. `relay.store` exports both names.
"""

from __future__ import annotations

import enum

from p2pnet.errors import ConfigError


class StoreTrouble(enum.Enum):
    """Why a `StoreBackoff` hold began."""

    FULL = "full"  # no room: the budget, or the disk (StoreFull, ENOSPC, EDQUOT)
    FAILING = "failing"  # the disk failed a write or an fsync otherwise (EIO and the like)


class StoreBackoff:
    """When to try a full or failing store again: pure (times are passed in), for the relay's
    fetching.

    The first failure starts a hold of `first_s`; a failure after a hold ended (the probe found
    the store still full, or its disk still failing) starts the next one, twice as long, up to
    `max_s`; failures inside a hold (requests that were already out) change nothing, not even
    its `cause` (what started it). `failed` returns the end of a new hold, once per hold, so the
    caller says so once per interval, not once per chunk. A store that succeeds ends the backoff
    (`succeeded` is True when one was running).
    """

    def __init__(self, first_s: float = 1.0, max_s: float = 60.0) -> None:
        if not 0 < first_s <= max_s:
            raise ConfigError("relay", "store backoff needs 0 < first_s <= max_s")
        self.first_s = first_s
        self.max_s = max_s
        self.hold_s = 0.0  # the current (or last) hold's length; 0 when not backing off
        self.until = -float("inf")
        self.failures = 0
        self.cause: StoreTrouble | None = None  # what started the current hold; None when not backing off

    @property
    def active(self) -> bool:
        """The store was full or failing and nothing has been stored since."""
        return self.hold_s > 0

    def failed(self, now: float, cause: StoreTrouble = StoreTrouble.FULL) -> float | None:
        """A store failed (`cause`): the end of a new hold, or None inside the current one."""
        self.failures += 1
        if now < self.until:
            return None
        self.hold_s = self.first_s if not self.active else min(2 * self.hold_s, self.max_s)
        self.until = now + self.hold_s
        self.cause = cause
        return self.until

    def succeeded(self) -> bool:
        """A store succeeded: back to normal. True if that ended a backoff."""
        was = self.active
        self.hold_s, self.until, self.cause = 0.0, -float("inf"), None
        return was

    def to_json(self, now: float) -> dict[str, object]:
        return {"backing_off": self.active, "cause": self.cause.value if self.cause is not None else None,
                "hold_s": self.hold_s, "retry_in_s": round(max(self.until - now, 0.0), 3) if self.active else 0.0,
                "failed_stores": self.failures}

"""The few errors p2pnet raises, named by who is at fault.

- `ConfigError`: the user gave a bad configuration value or flag (names the field).
- `MessageRejected`: a remote peer sent bytes we will not believe (garbage, oversized, unknown
  type, unsigned, mis-signed, stale). The receiver drops the message and penalises the sender.
- `PeerUnavailable`: a remote peer could not be reached or stopped answering in time.
- `LocalStateError`: our own files are unusable (corrupt key file, data directory locked).

Everything else is a bug and is allowed to crash loudly.
"""

from __future__ import annotations


class P2PNetError(Exception):
    """Base class of every error p2pnet raises on purpose."""


class ConfigError(P2PNetError, ValueError):
    """A configuration value is invalid; `field` names it (for example `peer.listen`)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class MessageRejected(P2PNetError):
    """A remote peer's message failed decoding or checking; `reason` is a short stable code.

    `sender` is the peer id the message claimed, when it got far enough to claim one.
    """

    def __init__(self, reason: str, detail: str = "", sender: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.sender = sender


class StaleMessage(MessageRejected):
    """A message whose timestamp is too far from our clock (reason "stale"). `age_s` is our clock
    minus its timestamp: positive when it looks old, negative when it comes from our future.
    Many of these from many peers mean our own clock is wrong (see `p2pnet.peertable.ClockSkew`)."""

    def __init__(self, age_s: float, sender: str | None = None) -> None:
        super().__init__("stale", f"timestamp off by {age_s:.1f}s", sender)
        self.age_s = age_s


class PeerUnavailable(P2PNetError):
    """A remote peer could not be reached, or did not answer within its deadline."""


class LocalStateError(P2PNetError):
    """Our own on-disk state is unusable; the message says which file and what to do."""

"""The transfer core's standing of its members and of its own link, for manifest asks.

Mixed into `relay.transfer.TransferCore` through `relay.manifest_asks.ManifestAsks`. Two things
a relay knows of itself that `relay.manifest_asks` orders and judges holders by:

How long each member has been one (`_member_since`, kept by `_note_members` from the core's
`set_members`): a member for `SETTLE_S` before a version was first asked for is settled for it
(`ManifestAsks._settled`), and stands in line before identities that joined since. Time in our
membership is what an identity cannot fake: its heartbeats must keep reaching us (one that left
and came back joined anew). It survives our restart: the shell keeps `members_seen` on disk
(`relay.member_record`) and gives it back at start (`recall_members`); a member recalled counts
its time from then if it is back within `RECALL_S`. Before stop 52 one heartbeat just before a
version's first ask settled an identity, and after our restart liars whose heartbeats came first
stood before a member whose heartbeat came later (asked at 120 s, not 60 s).

Whether our own link was up (`_hear`, `_link_silent`): a frame from anyone (a message, a
manifest answer, a chunk) says it was; an ask that timed out (`manifest_retry_s` or more) with
nothing heard from anyone since it was made timed out while it was down, and says nothing of its
holder (`ManifestAsks._offline`). A holder cannot make us hear nothing from
the others.

Bounded: `MAX_RECALLED` members recalled and recorded; `_member_since` follows the membership.
Like the core these methods do no I/O and take the time as an argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relay.planner import Membership

if TYPE_CHECKING:
    from relay.transfer import TransferConfig


SETTLE_S = 300.0  # in our membership this long before a version was first asked for: settled for it (`_settled`)
RECALL_S = 600.0  # a member recalled from before our restart counts its time only if it is back within this
MAX_RECALLED = 8192  # members recalled from before our restart (`recall_members`), and recorded (`member_record.save`)


class MemberStanding:
    """Members' standing and our link's for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods use (`TransferCore.__init__` sets it)
    config: TransferConfig
    _member_since: dict[str, float]  # member -> since when, in our membership (`_settled`)
    _member_recalled: dict[str, float]  # member before our restart -> since when (`recall_members`)
    _recalled_until: float  # recalled members count their time if back before this
    _heard_at: float  # when a frame last reached us, from anyone (`_hear`)
    _heard_before: float  # the last time before `_heard_at` that one did

    def _note_members(self, now: float, members: Membership) -> None:
        """Our membership is `members` now: since when each has been in it (`_settled`); one that
        left is forgotten (one that comes back joined anew), one recalled from before our restart
        (`recall_members`) counts from then if it is back within `RECALL_S` of our start."""
        since, recalled = self._member_since, self._member_recalled
        for peer in [p for p in since if p not in members.uploads]:
            del since[peer]
        if recalled and now > self._recalled_until:
            recalled.clear()
        for peer in members.uploads:
            if peer not in since:
                since[peer] = min(now, recalled.pop(peer, now))

    def members_seen(self, now: float) -> dict[str, float]:
        """Our members and how long each has been one (seconds): what the shell keeps on disk
        to `recall_members` after a restart (`relay.member_record.save` writes the longest
        `MAX_RECALLED`, sorting them in its worker thread, not in this command)."""
        return {peer: now - since for peer, since in self._member_since.items()}

    def recall_members(self, now: float, ages: dict[str, float]) -> list[Any]:
        """After our restart (a command, effects none): these were our members, each for
        `ages[peer]` seconds when the shell last kept them (`members_seen`; the time we were down
        is not counted: who left meanwhile we cannot know). One back in our membership within
        `RECALL_S` (its heartbeat reached us again) counts that time as its own (`_note_members`),
        so a restart does not make a newcomer of a member whose heartbeat comes after liars'; the
        longest first, at most `MAX_RECALLED`."""
        longest = sorted(ages.items(), key=lambda item: -item[1])[:MAX_RECALLED]
        self._member_recalled = {peer: now - age for peer, age in longest if age >= 0}
        self._recalled_until = now + RECALL_S
        since = self._member_since
        for peer in since:
            if peer in self._member_recalled:
                since[peer] = min(since[peer], self._member_recalled.pop(peer))
        return []

    def _hear(self, now: float) -> None:
        """A frame reached us (a message, a manifest answer, a chunk): our link was up (`_link_silent`)."""
        if now != self._heard_at:
            self._heard_before, self._heard_at = self._heard_at, now

    def _link_silent(self, now: float, since: float) -> bool:
        """Whether an ask made at `since` that failed unanswered at `now` timed out while our own
        link was down: at least `manifest_retry_s` on (a timeout, not a refused connection, which
        comes at once) and no frame reached us from anyone since the ask (the one that came at
        `now` left out). It says nothing of its holder then (`relay.manifest_answers`'
        `manifest_failed`, the `manifest_retry_s` lapse: `ManifestAsks._offline`). A holder cannot
        make us hear nothing from the others; in a network quiet for that long, one that never
        answers is asked again as if we were offline (`MAX_OFFLINE` times per version). A frame
        heard after the ask, before our link went down, leaves the holder judged as before
        (the last `manifest_retry_s` alone, a quiet stretch common in small networks, judged
        holders that time out there, and passed over none, in the tests' worlds)."""
        heard = self._heard_before if self._heard_at >= now else self._heard_at
        return heard <= since and now - since >= self.config.manifest_retry_s

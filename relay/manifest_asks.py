"""The transfer core's manifest asks: whom to ask for a version's manifest, when, and after a failure.

Mixed into `relay.transfer.TransferCore` (`ManifestAsks`). A `Holding` for a version we do not
know (`relay.announce`) asks the sender for the manifest (`_ask_manifest`, at most every
`manifest_retry_s` per version, never for a version we garbage-collected, and with at most
`MAX_MANIFEST_ASKS` asks remembered: any peer may name any version, and past the bound the asks
of the peer we asked most give way, `_room_to_ask`), and the answer makes it a holder.
The swarm layout's `HaveChunks` asks the same way, for a sender that holds only some chunks
(its answer then makes it no holder).

One ask of a version is in flight at a time, but for a member's `Holding` while a stranger's ask
waits (below) and a `Holding` `manifest_retry_s` after the last ask (that ask may overlap one
still in flight; that ask then counts as failed, `_rank`, and the `Holding` asks the first
remembered, `_after_failure`, not its sender: a holder that never answers, whose failure after
the shell's `request_timeout_s` comes late and asks nothing, and that names the version every
second was otherwise asked again at each retry, and an honest member remembered never; 1, 8, 100
such liars: the member asked at 5, 40, 500 s, about `manifest_retry_s` each). With the ask we
remember up to `MAX_OTHER_HOLDERS` (128; 16 before stop 50, when 100 liars naming a version
before an honest member and fresh identities coming faster than asks are made, 1 or 10 per
second, kept it from being asked for ever: each freed place was taken by the next fresh
identity within the second; now it is remembered at its first `Holding` when fewer than 128
named the version before it, then never pushed out (but, if it joined our membership since the
version was first asked for, by a settled member: below), and no identity named after it, ranked
never failed like it, is asked before it: 125 / 125 / 130 s, 0.5 / 1 / 10 fresh per second) other holders that
named the version meanwhile (`_remember_other`: one usable takes the place of the first excluded
for now, a member that of the first stranger, and one usable that of the last of its kind in
line, if after it (`_order`); so neither made-up identities, excluded liars
nor liars that failed keep its members out); they go with the ask (`_drop_asks`:
the manifest came, the version was forgotten, `_room_to_ask` evicted the ask), so they count
within `MAX_MANIFEST_ASKS`.

The shell reports every failed ask (`manifest_failed`) with its `FetchFailure` and the ask's time
(`FetchManifest.asked_at`): a late report of an earlier ask, of another holder or of the same one
asked again, asks nothing. An answer that gives us no manifest of the version is a broken one
(`manifest_answer`). The next usable remembered holder is asked at once, a member first
(`_ask_another`): the next `Holding` of the version may be minutes away at scale. Each failure
makes at most one new ask, and the asks made because one failed (of a remembered holder, or by a
member's `Holding`, below) are at most `MAX_ASKS_AFTER_FAILURES` (4) per `manifest_retry_s` per
version (`_spend`), one of them kept for a member: holders that fail at once and name the
version again and again (a `Holding` costs nothing) cannot have an ask made of each `Holding`,
and strangers (asked only while no member is remembered) cannot spend the bound before a member
names the version (100 strangers failing at once: a member naming it at 0.5 s was asked at
0.51 s; 5.02 s without the share kept). Once an ask has failed, every ask of the version goes
to the first remembered holder (`_after_failure`): a `Holding` only joins them (members taking
strangers' places), whether it asks at once (a member's, within the bound) or `manifest_retry_s`
after the last ask; with the bound spent the ask is put off until it allows one
(`_manifest_again`, of whoever is first then). A stranger's `Holding` that asks nothing (it may
ask once per `manifest_retry_s`, failure or not) puts one off to `manifest_retry_s` after the
last ask, when it would have asked (of whoever is first then), and one of a holder excluded for
now to when the first remembered may be asked (`_ask_when_usable`): a `Holding` may not come
again for an announce interval. First means a member first, then the one whose ask (of any
version, the last `MAX_FAILED_ASKS` peers) failed longest ago, never first, then a member since
before the version was first asked for before one that joined since, then first named (`_rank`,
`_order`; a settled member takes a newcomer's place when the places are full, so more than 128
liars naming a version first, and fresh identities joining as places free, keep it out only
until each liar settled before was asked once: 200 liars, 1 fresh per second, asked at 245 s, not
in 600 s before). So identities that spend the bound and name the version again and again cannot ask
ahead of a holder remembered from one `Holding`, and liars, however many, are each asked once
before any is asked again: K members naming a version every second and answering "not held"
keep an honest member that names it every 30 s waiting at most until each was asked once (at
4 asks per 5 s) and its next `Holding` (core alone, `exclude_s` 60 s; 8, 20, 100, 1000 liars, it
first naming the version at 0.5, 1.5 or 7.3 s: asked by 7.3, 20.1, 130.0, 1245.1 s; before, 100
or more liars kept it out of the 16 places for 600 s but when it first named it at 0.5 s, 80 s).
Any identity the others cannot tell from the honest one costs it an ask; the rate of asks is as
before.

A member's `Holding` (its heartbeat, with its address, has come) asks at once, within
`manifest_retry_s` of the last ask, when the holder asked is no member (its ask may wait for an
address that never comes: anyone may send `Holding`; `_asks_instead`) or its ask failed (within
`_spend`'s bound, of the first remembered: `_after_failure`). A new ask replaces the one put off,
so a member asked instead is not passed over in its turn while its ask is in flight. Strangers'
`Holding`s ask at most once per `manifest_retry_s` per version.

What an answer, or a failure, does to the holder asked (excluded, banned, asked again later) and
the manifests our store refused: `relay.manifest_answers`.

These methods read the core's configuration, membership, versions, exclusions, bans and
`_manifest_failed_at`, and keep `_manifest_asked`, `_manifest_again` and `_manifest_others`; they
also call the core's `_usable(now, peer)` and `relay.manifest_answers`' `_store_refused`. Like
the core they do no I/O and take the time as an argument.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from relay.effects import FetchManifest
from relay.manifest_standing import SETTLE_S, MemberStanding
from relay.planner import Membership

if TYPE_CHECKING:
    from relay.transfer import TransferConfig
    from relay.transfer_state import _Version


MAX_MANIFEST_ASKS = 1024  # versions asked for and not yet answered, remembered at once (any peer may name any)
MAX_OTHER_HOLDERS = 128  # per version asked for: other holders that named it, asked when an ask fails
MAX_ASKS_AFTER_FAILURES = 4  # per version, per `manifest_retry_s`: asks made because one failed (`_spend`)
MAX_DECLINED = 2 * MAX_OTHER_HOLDERS  # per version asked for: holders that declined its ask (`manifest_declined`)
MAX_OFFLINE = 3  # per version asked for: asks that timed out while our link was down, excused (`_offline`)


class _Ask(NamedTuple):
    """The manifest ask of a version we remember: when, of whom, whether it holds all of it
    (a `Holding`; not a `HaveChunks`), whether the ask failed (`manifest_failed`), and when the
    version was first asked for (`_settled`)."""

    at: float
    peer: str
    holds_all: bool
    failed: bool = False
    first: float = math.inf


@dataclass(slots=True)
class _Others:
    """Other holders that named a version asked for (peer -> it holds all), first named first,
    at most `MAX_OTHER_HOLDERS`; the asks made since `since` because one failed (`_spend`: at
    most `MAX_ASKS_AFTER_FAILURES`); and the last `MAX_DECLINED` holders that declined its ask
    (peer -> when: `manifest_declined`), first declined first, not asked for it for `exclude_s`."""

    named: dict[str, bool] = field(default_factory=dict)
    since: float = -math.inf
    after_failures: int = 0
    of_strangers: int = 0  # of them, asks of strangers (`_spend`: one is kept for a member)
    declined: dict[str, float] = field(default_factory=dict)
    offline: int = 0  # asks of it that timed out while our link was down (`_link_silent`), excused


class ManifestAsks(MemberStanding):
    """Manifest asks for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods use (`TransferCore.__init__` sets it)
    config: TransferConfig
    _members: Membership
    _versions: dict[int, _Version]
    _excluded: dict[str, float]
    _banned: set[str]
    _manifest_asked: dict[int, _Ask]
    _manifest_again: dict[int, tuple[float, str]]  # version -> when to ask whom again (`manifest_failed`)
    _manifest_others: dict[int, _Others]  # version asked for -> other holders that named it
    _manifest_failed_at: dict[str, float]  # peer -> when an ask of it last failed, first failed first (`_rank`)
    _member_since: dict[str, float]  # member -> since when, in our membership (`_settled`)
    _manifest_excused: dict[str, int]  # peer -> the version whose ask failed, nobody's fault, unranked (`_settled`)
    _collected_through: int

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _usable(self, now: float, peer: str) -> bool: ...
        def _store_refused(self, manifest_id: bytes) -> bool: ...
        def _failed(self, now: float, version: int, asked: _Ask, blamed: bool = ...) -> None: ...

    def _ask_manifest(self, now: float, sender: str, version: int, manifest_id: bytes, effects: list[Any],
                      holds_all: bool = True) -> bool:
        """`sender` holds a version we do not know (all of it, or with `holds_all` False some
        chunks of it), as the manifest `manifest_id`: ask it for the manifest, or remember it as
        another holder to ask should the ask in flight fail; its answer makes it a holder only in
        the first case. False when there was no room to remember the ask (`_room_to_ask`), at
        this `now`, for any new version `sender` names."""
        if version <= self._collected_through or self._store_refused(manifest_id):
            return True  # collected here: we do not want it back; or our store would not keep it
        asked = self._manifest_asked.get(version)
        if asked is not None and not asked.failed and now - asked.at >= self.config.manifest_retry_s \
                and sender not in self._banned and self._usable_for(now, version, sender):
            if self._offline(now, version, asked):  # nothing came from anyone since: our link was down
                self._asked(now, version, asked.peer, asked.holds_all, effects)  # up again: the same one
                if sender != asked.peer:
                    self._remember_other(now, version, sender, holds_all)
                return True
            self._failed(now, version, asked)  # unanswered for `manifest_retry_s`: the first remembered asked
            asked = self._manifest_asked[version]
        if asked is not None and asked.failed and sender not in self._banned:
            self._after_failure(now, version, asked, sender, holds_all, effects)
        elif self._usable_for(now, version, sender) and (asked is None
                                                         or now - asked.at >= self.config.manifest_retry_s
                                                         or self._asks_instead(asked, sender)):
            if asked is None and len(self._manifest_asked) >= MAX_MANIFEST_ASKS and not self._room_to_ask(now, sender):
                return False
            self._asked(now, version, sender, holds_all, effects)
        elif asked is not None and sender != asked.peer and sender not in self._banned:
            self._remember_other(now, version, sender, holds_all)
        return True

    def _after_failure(self, now: float, version: int, asked: _Ask, sender: str, holds_all: bool,
                       effects: list[Any]) -> None:
        """`sender` named `version`, whose last ask failed: it joins the holders remembered, and
        the first of them (a member first, then the one whose ask failed longest ago, then first
        named: `_ask_another`) is asked, not `sender` itself unless it is that one, when a
        `Holding` would have asked before the failure (`manifest_retry_s` after the last ask) or a member's asks instead (within
        `_spend`'s bound). So holders that name the version again and again cannot jump the line
        of those remembered, which a `Holding` seldom renews, nor spend its asks ahead of them.
        A `Holding` that asks nothing puts an ask off (see the top): a stranger's, usable, to
        when it would have asked; one of a holder excluded for now to when one may be asked."""
        if sender != asked.peer or now - asked.at >= self.config.manifest_retry_s:
            self._remember_other(now, version, sender, holds_all)
        if now - asked.at >= self.config.manifest_retry_s:
            self._ask_another(now, version, effects, spend=False)
        elif sender in self._members.uploads and self._usable_for(now, version, sender):
            self._ask_another(now, version, effects)
        if self._manifest_asked[version] is asked and version not in self._manifest_again:
            others = self._manifest_others.get(version)
            if others is not None and any(self._usable_for(now, version, p) for p in others.named):
                self._manifest_again[version] = (asked.at + self.config.manifest_retry_s, "")  # as a `Holding` then
            else:
                self._ask_when_usable(now, version)

    def _asked(self, now: float, version: int, peer: str, holds_all: bool, effects: list[Any]) -> None:
        """Ask `peer` for the manifest of `version`: the one ask of it in flight (it replaces any
        other, and any put off: `_asks_instead`, `manifest_failed`)."""
        before = self._manifest_asked.get(version)
        self._manifest_asked[version] = _Ask(now, peer, holds_all, first=now if before is None else before.first)
        self._manifest_again.pop(version, None)
        others = self._manifest_others.get(version)
        if others is not None:
            others.named.pop(peer, None)
        effects.append(FetchManifest(peer, version, now))

    def _remember_other(self, now: float, version: int, peer: str, holds_all: bool) -> None:
        """`peer` named `version`, asked of another: kept to ask should that ask fail, at most
        `MAX_OTHER_HOLDERS` per version; one usable takes the place of the first excluded for now
        (liars, excluded, must not keep the room), a member that of the first stranger named, and
        a stranger is kept only while there is room (anyone may send `Holding`)."""
        others = self._manifest_others.setdefault(version, _Others())
        named = others.named
        if peer in named or len(named) < MAX_OTHER_HOLDERS:
            named[peer] = holds_all
            return
        members = self._members.uploads
        usable = self._usable_for(now, version, peer)
        gone = next((p for p in named if usable and not self._usable_for(now, version, p)), None)
        if gone is None and peer in members:
            gone = next((p for p in named if p not in members), None)
        if gone is None and usable:  # the last of its kind in line (`_order`), if after `peer`
            kind = [p for p in named if (p in members) == (peer in members)]
            last = max(reversed(kind), key=lambda p: self._order(version, p), default=None)
            if last is not None and self._order(version, last) > self._order(version, peer):
                gone = last
        if gone is not None:
            del named[gone]
            named[peer] = holds_all

    def _ask_another(self, now: float, version: int, effects: list[Any], spend: bool = True) -> bool:
        """The ask of `version` failed: ask the first usable holder that named it since, a member
        first, then the one whose ask failed longest ago (`_rank`), at once, within `_spend`'s
        bound (unless `spend` is False: an ask a `Holding` would have made anyway); whether one
        was asked. With the bound spent, the ask is put off until
        it allows one (`_manifest_again`, of whoever is first then), so the holders that spent it
        cannot then ask ahead of those remembered by naming the version again."""
        others = self._manifest_others.get(version)
        if others is None:
            return False
        members = self._members.uploads
        usable = [p for p in others.named if self._usable_for(now, version, p)]
        peer = min(usable, key=lambda p: (p not in members, *self._order(version, p)), default=None)
        if peer is None:
            return False
        if spend and not self._spend(now, version, peer in members):
            self._manifest_again[version] = (others.since + self.config.manifest_retry_s, "")
            return False
        self._asked(now, version, peer, others.named[peer], effects)
        return True

    def _usable_for(self, now: float, version: int, peer: str) -> bool:
        """Whether `peer` may be asked for `version`'s manifest: usable (`_usable`), and it has not
        declined an ask of it in the last `exclude_s` (`manifest_declined`: as if excluded)."""
        return self._usable(now, peer) and now - self._declined_at(version, peer) >= self.config.exclude_s

    def _declined_at(self, version: int, peer: str) -> float:
        """When `peer` last declined an ask of `version` (`manifest_declined`; -inf: not of late)."""
        others = self._manifest_others.get(version)
        return others.declined.get(peer, -math.inf) if others is not None else -math.inf

    def _put_off(self, version: int) -> bool:
        """Whether an ask of `version` is put off until `_spend`'s bound allows one (`_ask_another`)."""
        again = self._manifest_again.get(version)
        return again is not None and not again[1]

    def _spend(self, now: float, version: int, of_member: bool) -> bool:
        """Whether an ask of `version` (of a member or not: `of_member`) may be made because one
        failed (`_ask_another`, or a member's `Holding`: `_after_failure`), counted if so: at most
        `MAX_ASKS_AFTER_FAILURES` per `manifest_retry_s` per version, one of them kept for a
        member. Holders that fail at once (members included: each new identity may fail once
        before it is excluded) and name the version again and again must not make an ask of every
        `Holding`; strangers (anyone may send `Holding`, and a stranger is asked only while no
        member is remembered) must not spend the bound a member named since would be asked in."""
        others = self._manifest_others.setdefault(version, _Others())
        if now >= others.since + self.config.manifest_retry_s:  # (the sum `_ask_another` puts an ask off to)
            others.since, others.after_failures, others.of_strangers = now, 0, 0
        if others.after_failures >= MAX_ASKS_AFTER_FAILURES \
                or (not of_member and others.of_strangers >= MAX_ASKS_AFTER_FAILURES - 1):
            return False
        others.after_failures += 1
        others.of_strangers += not of_member
        return True

    def _rank(self, peer: str) -> float:
        """When an ask of `peer` last failed, for any version and any reason (-inf: none remembered):
        of the holders remembered, the one whose ask failed longest ago is asked first, and kept
        first (`_ask_another`, `_remember_other`), so identities that failed are asked again only
        once all the others were asked."""
        return self._manifest_failed_at.get(peer, -math.inf)

    def _order(self, version: int, peer: str) -> tuple[float, bool]:
        """Where `peer` stands in line for `version` among holders of its kind (members, or
        strangers), first first: by when its ask last failed (`_rank`), then a member settled
        before the version was first asked for (`_settled`) before one that joined since; then
        first named. Any number of identities may join our membership as a version spreads and
        name it first, never failing until asked (200 liars naming a version in its first second,
        fresh ones at 1 or 10 per second: an honest member naming it every 30 s was not asked in
        600 s); those settled before it are a number fixed before it was named, each asked once
        before any that failed is asked again."""
        return self._rank(peer), not self._settled(version, peer)

    def _settled(self, version: int, peer: str) -> bool:
        """Whether `peer` has been a member for `SETTLE_S` before `version` was first asked for
        (`_order`), and its ask of `version` has not failed excused (`relay.manifest_answers`'
        `_failed`: a failure nobody's fault keeps its rank, but it stands in line for the version
        as one that joined since, from when it named it again). Any identity may fail so once, and excused,
        settled liars were asked twice before a member that joined since (100 liars declining
        each ask, the member joining at 1 s: asked at 245 s; 120 s at stop 50, now 125 s), or
        before a settled one that the places kept out until they named the version again (200
        liars declining, 1 fresh identity a second: 475 s, 181 liars asked twice; now 245 s, none).
        A member's time counts from our first sight of it, before our restart too (`recall_members`):
        one heartbeat just before a version's first ask settled an identity, and after our restart
        liars beating first stood before a member beating later (asked at 120 s, not 60 s); now an
        identity must stay in our membership, beating, for `SETTLE_S`."""
        asked = self._manifest_asked.get(version)
        return asked is not None and self._member_since.get(peer, math.inf) + SETTLE_S <= asked.first \
            and self._manifest_excused.get(peer) != version

    def _offline(self, now: float, version: int, asked: _Ask) -> bool:
        """Whether the ask `asked` of `version`, unanswered at `now`, timed out while our own link
        was down (`_link_silent`), and is excused so, at most `MAX_OFFLINE` times per version (a
        holder that never answers in a network quiet that long is then judged as any other):
        if so it failed with no verdict on its holder, which keeps its rank, its excuse and the
        first place in line (`_put_first`), to be asked again."""
        others = self._manifest_others.setdefault(version, _Others())
        if others.offline >= MAX_OFFLINE or not self._link_silent(now, asked.at):
            return False
        others.offline += 1
        self._manifest_asked[version] = asked._replace(failed=True)
        self._put_first(version, asked.peer, asked.holds_all)
        return True

    def _put_first(self, version: int, peer: str, holds_all: bool) -> None:
        """`peer` stands first in line for `version` among those remembered (`_ask_another`, of its
        kind and rank), the last in line giving way if the places are full."""
        others = self._manifest_others.setdefault(version, _Others())
        rest = [(p, a) for p, a in others.named.items() if p != peer][:MAX_OTHER_HOLDERS - 1]
        others.named = {peer: holds_all, **dict(rest)}

    def _ask_when_usable(self, now: float, version: int) -> None:
        """No holder of `version` remembered may be asked now: the first whose exclusion ends (from
        us, or, having declined an ask of it, for `version`) is asked then (`_ask_again`)."""
        later = {p: until for p in self._manifest_others.get(version, _Others()).named
                 if (until := self._usable_from(now, version, p)) > now and p not in self._banned}
        if later:
            first = min(later, key=later.__getitem__)
            self._manifest_again[version] = (later[first], first)

    def _usable_from(self, now: float, version: int, peer: str) -> float:
        """When `peer`'s exclusion ends, from us or, having declined an ask of it, for `version`
        (`_usable_for`); `now` or before if it has none."""
        return max(self._excluded.get(peer, now), self._declined_at(version, peer) + self.config.exclude_s)

    def _drop_asks(self, version: int) -> _Ask | None:
        """Forget the asks of `version` (its manifest came, or it was forgotten): the one made,
        one put off and the other holders; the ask made, if any."""
        self._manifest_again.pop(version, None)
        self._manifest_others.pop(version, None)
        return self._manifest_asked.pop(version, None)

    def _asks_instead(self, asked: _Ask, sender: str) -> bool:
        """Whether `sender`'s `Holding` asks for a version though `asked.peer` was asked for it
        less than `manifest_retry_s` ago, and that ask has not failed (`_after_failure` says what
        a `Holding` does after a failure): `sender` is a member (its heartbeat, with its address,
        has reached us) and the one asked is not (its ask may wait for an address that never
        comes: anyone may send `Holding`). Strangers' `Holding`s ask at most once per
        `manifest_retry_s` per version."""
        members = self._members.uploads
        return sender in members and sender != asked.peer and asked.peer not in members

    def _ask_again(self, now: float, effects: list[Any]) -> None:
        """Make the asks `manifest_failed` put off that are due, unless the version is known
        now, another holder was asked since (and has not failed), or the holder is banned; one
        excluded is asked at the exclusion's end."""
        for version, (at, peer) in list(self._manifest_again.items()):
            if at > now:
                continue
            del self._manifest_again[version]
            asked = self._manifest_asked.get(version)
            if asked is None or not asked.failed or version in self._versions or peer in self._banned \
                    or version <= self._collected_through:
                continue
            if not peer:  # put off by `_spend`'s bound: whoever is first among those remembered now
                self._ask_another(now, version, effects)
                continue
            until = self._usable_from(now, version, peer)
            if until > now:
                self._manifest_again[version] = (until, peer)
                continue
            others = self._manifest_others.get(version)
            self._asked(now, version, peer, others.named.get(peer, asked.holds_all) if others else asked.holds_all,
                        effects)

    def _asks_due_at(self) -> float:
        """When the first ask `manifest_failed` put off is due (inf: none is)."""
        return min((at for at, _ in self._manifest_again.values()), default=math.inf)

    def _room_to_ask(self, now: float, sender: str) -> bool:
        """With `MAX_MANIFEST_ASKS` asks remembered (any peer may name any version, and made-up
        ones are never answered): forget those that may be made again; while none may, forget
        one ask made of the peer we asked most, unless that is `sender` itself. A peer that names
        ever new versions thus crowds out only its own asks (at most the bound per
        `manifest_retry_s`), and a real holder, which names few, is asked at once."""
        retry_s = self.config.manifest_retry_s
        for version in [n for n, a in self._manifest_asked.items() if now - a.at >= retry_s]:
            self._drop_asks(version)
        if len(self._manifest_asked) < MAX_MANIFEST_ASKS:
            return True
        counts = Counter(a.peer for a in self._manifest_asked.values())
        most = max(counts, key=lambda peer: (counts[peer], peer))
        if counts[sender] >= counts[most]:
            return False
        self._drop_asks(next(n for n, a in self._manifest_asked.items() if a.peer == most))
        return True

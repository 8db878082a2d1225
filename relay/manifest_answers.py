"""The transfer core's manifest answers: what an answer to a manifest ask, or its failure, does.

Mixed into `relay.transfer.TransferCore` (`ManifestAnswers`), beside `relay.manifest_asks`, which
asks (whom, when, and another holder at once when an ask fails: `_ask_another`). Here, the shell's
reports of asks (`manifest_failed`, `manifest_answer`, `manifest_declined`): the verdict on the
holder, and the manifests our store refused.

The holder whose ask failed is dealt with as the failure says, as a source of chunks would be
(`relay.failures`). `no_address` (its heartbeat, with its data address, has not reached us: we
heard of it from its `Holding` alone) is nobody's fault: asked again `not_admitted_s` later (on
the tick, `_ask_again`; the shell waits for the address anew), for `NO_ADDRESS_GRACE_S` from its
first `no_address` in a row, then excluded as unreachable, so a holder that never sends a
heartbeat is not asked for ever. `not_admitted` (it has not heard our heartbeat; the shell has
just sent it ours): asked again the same way, counted with its refusals of chunks, and
unreachable after `NOT_ADMITTED_TRIES` in a row (`_refused_us`). If another holder was asked
instead, these two are remembered as other holders rather than asked again on the tick; after
any other failure that leaves none to ask, one remembered but excluded for now (from us, or for
this version: below) is asked as its exclusion ends (`_ask_when_usable`). `unreachable` (no
connection, or too slow with its address known): excluded for `exclude_s`. `corrupt` (a broken
answer, on a connection that proved its id: bytes that are no signed manifest, or another
version's): banned and penalised. `unavailable` for a version its `Holding` named in full (it
lied, or dropped it since): excluded for `exclude_s`. An excluded holder's `Holding` asks nothing
at once, so holders that name a version and fail its asks at once cannot keep one that names it
rarely from being asked. A sound manifest of the version that we will not
take (signed by a publisher we do not trust, or stamped beyond our clock's reach: the holder's
trust or clock differs from ours) fails its ask with no verdict on the holder (`_not_for_us`),
and one of an untrusted publisher is then remembered as one our store refused (below). So does
an answer with a status we do not know (`manifest_declined`), whose holder then counts, for that
version alone, as excluded for `exclude_s` (liars never excluded must not keep the line full).
Each of these failures that is nobody's fault (`not_admitted` or `no_address` asked again later,
a sound manifest we will not take, a status we do not know) is excused once per holder: it does
not rank the holder behind those that never failed (`_failed`, `relay.manifest_asks`' `_rank`),
but for that version it stands in line as a member that joined since (`_settled`).

A manifest our store would not keep (`refuse_manifest`: it holds another one for that version,
an equivocating publisher's) is remembered by its id, the last `MAX_REFUSED_MANIFESTS` of them:
an announce naming it asks for nothing, and its frame, from gossip or an answer, is dropped
before it is opened (`_refused_frame`), where each announce had it fetched, opened, accepted and
refused by the store again, and logged. Another manifest for the version is still taken. The
shell does not call this for a refusal that may pass (a full store, a failing disk): the core
just forgets the version then (`forget`), and takes it again at the next announce.

These methods read the core's configuration, versions and bans, keep `_manifest_asked`,
`_manifest_again`, `_manifest_failed_at` and `_refused_manifests`, and count refusals in
`_refused`; they also call the core's `_arm(now, effects)`, `forget(version)` and
`_take_manifest(now, sender, frame, effects)`, `relay.failures`' `_unaddressed_for`, `_exclude`
and `_ban`, and `relay.manifest_asks`' `_ask_another`, `_put_off`, `_remember_other` and
`_ask_when_usable`. Like the core they do no I/O and take the time as an argument.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import blake3

from relay.effects import DropReason, FetchFailure
from relay.errors import ManifestRejected
from relay.failures import NO_ADDRESS_GRACE_S, NOT_ADMITTED_TRIES
from relay.manifest_asks import MAX_DECLINED, _Ask, _Others

if TYPE_CHECKING:
    from relay.manifest import SignedManifest
    from relay.transfer import TransferConfig
    from relay.transfer_state import _Version


MAX_FAILED_ASKS = 4096  # peers whose last failed manifest ask we remember, to rank holders by (`_rank`)
MAX_REFUSED_MANIFESTS = 64  # manifests our store would not keep, remembered (the least recently named go first)
_NOT_THE_HOLDERS = frozenset({"untrusted_publisher", "stale"})  # a sound manifest we will not take (`_not_for_us`)


class ManifestAnswers:
    """Manifest answers for `relay.transfer.TransferCore` (see the module docstring)."""

    # the core's state these methods use (`TransferCore.__init__` sets it)
    config: TransferConfig
    _versions: dict[int, _Version]
    _excluded: dict[str, float]
    _refused: dict[str, int]
    _banned: set[str]
    _manifest_asked: dict[int, _Ask]
    _manifest_again: dict[int, tuple[float, str]]  # version -> when to ask whom again (`manifest_failed`)
    _manifest_others: dict[int, _Others]  # version asked for -> other holders that named it
    _manifest_failed_at: dict[str, float]  # peer -> when an ask of it last failed, first failed first (`_failed`)
    _manifest_excused: dict[str, int]  # peer -> the version whose ask failed, nobody's fault, unranked (`_failed`)
    _refused_manifests: OrderedDict[bytes, int]  # manifest id -> its version

    if TYPE_CHECKING:  # what these call on the core (`relay.transfer.TransferCore` or another of its mixins)
        def _arm(self, now: float, effects: list[Any]) -> list[Any]: ...
        def forget(self, version: int) -> list[Any]: ...
        def _take_manifest(self, now: float, sender: str, frame: bytes,
                           effects: list[Any]) -> SignedManifest | ManifestRejected | None: ...
        def _unaddressed_for(self, now: float, peer: str) -> float: ...
        def _exclude(self, now: float, peer: str, why: DropReason, effects: list[Any]) -> None: ...
        def _ban(self, now: float, peer: str, effects: list[Any], what: str = ...) -> None: ...
        def _ask_another(self, now: float, version: int, effects: list[Any], spend: bool = True) -> bool: ...
        def _put_off(self, version: int) -> bool: ...
        def _remember_other(self, now: float, version: int, peer: str, holds_all: bool) -> None: ...
        def _ask_when_usable(self, now: float, version: int) -> None: ...
        def _hear(self, now: float) -> None: ...
        def _offline(self, now: float, version: int, asked: _Ask) -> bool: ...

    def refuse_manifest(self, version: int, manifest_id: bytes) -> list[Any]:
        """Our store would not keep this manifest of `version` (it holds another for the version):
        forget the version, and take this manifest no more (see the top)."""
        refused = self._refused_manifests
        refused[manifest_id] = version
        refused.move_to_end(manifest_id)
        while len(refused) > MAX_REFUSED_MANIFESTS:
            refused.popitem(last=False)
        return self.forget(version)

    def _store_refused(self, manifest_id: bytes) -> bool:
        """Whether our store refused this manifest (`refuse_manifest`); naming it keeps it remembered."""
        if manifest_id not in self._refused_manifests:
            return False
        self._refused_manifests.move_to_end(manifest_id)
        return True

    def _refused_frame(self, frame: bytes) -> bool:
        """Whether `frame` is a manifest our store refused: its id is its hash, checked before
        the frame is opened (decoding a large manifest takes about 0.1 s; hashing it is cheap)."""
        return bool(self._refused_manifests) and self._store_refused(blake3.blake3(frame).digest())

    def manifest_failed(self, now: float, peer: str, version: int, reason: FetchFailure,
                        asked_at: float | None = None) -> list[Any]:
        """Our `FetchManifest` of `version` from `peer` failed for `reason` (the shell reports every
        failure, with the ask's `asked_at`; None: whichever ask of `peer` is in flight). Another
        holder that named it is asked at once (`_ask_another`); `peer`, after `no_address` (its
        heartbeat has not reached us yet) or `not_admitted` (ours has not reached it), is asked
        again later, and after any other failure waits for its next `Holding` (see the top)."""
        asked = self._manifest_asked.get(version)
        if asked is None or asked.peer != peer or asked_at not in (None, asked.at) or version in self._versions:
            return []  # (another ask was made since, of another holder or of `peer` again, or the manifest came)
        effects: list[Any] = []
        if reason is FetchFailure.UNREACHABLE and self._offline(now, version, asked):  # our link was down
            self._manifest_again[version] = (now + self.config.not_admitted_s, peer)  # (or a `Holding`, once up)
            return self._arm(now, effects)
        again = False
        if reason is FetchFailure.NOT_ADMITTED:
            again = self._refused_us(now, peer, effects)
        elif reason is FetchFailure.NO_ADDRESS:
            again = self._unaddressed_for(now, peer) < NO_ADDRESS_GRACE_S
            if not again and self._excluded.get(peer, 0.0) <= now:  # a ghost: unreachable, as a source
                self._exclude(now, peer, DropReason.UNREACHABLE, effects)
        elif reason is FetchFailure.CORRUPT:  # it broke the protocol, on a connection that proved its id
            self._ban(now, peer, effects, "broken manifest answer")
        elif reason is FetchFailure.UNREACHABLE:  # as a source of chunks
            self._exclude(now, peer, DropReason.UNREACHABLE, effects)
        elif asked.holds_all:  # unavailable: its `Holding` named the version, and it says it has not got it
            self._exclude(now, peer, DropReason.UNAVAILABLE, effects)
        self._failed(now, version, asked, blamed=not again)
        if self._ask_another(now, version, effects) or self._put_off(version):
            if again:  # asked once usable, should the other fail too
                self._remember_other(now, version, peer, asked.holds_all)
        elif again:
            self._manifest_again[version] = (now + self.config.not_admitted_s, peer)
        else:
            self._ask_when_usable(now, version)
        return self._arm(now, effects)

    def manifest_answer(self, now: float, peer: str, version: int, frame: bytes,
                        asked_at: float | None = None) -> list[Any]:
        """`peer` answered our `FetchManifest` of `version` (made at `asked_at`) with `frame`: taken
        as any manifest frame (`manifest_frame`). One that gives us no manifest of `version` and
        is no sound manifest of it (it does not open as a signed manifest, or opens as another
        version's) is a broken answer (`manifest_failed`, `corrupt`), not an ask left in flight for
        `manifest_retry_s` with no verdict on its holder. A sound manifest of `version` that we
        will not take is no fault of the holder's (our store refused it, `refuse_manifest`; it is
        signed by a publisher we do not trust, or stamped out of our clock's reach, though its
        holder's trust and clock took it): its ask fails and another holder is asked, and it is
        held against nobody (`_not_for_us`)."""
        effects: list[Any] = []
        self._hear(now)
        opened = self._take_manifest(now, peer, frame, effects)
        if version in self._versions and opened is not None and not isinstance(opened, ManifestRejected):
            self._manifest_excused.pop(peer, None)  # it answered: excused again (`_failed`)
        if version in self._versions or opened is None:
            return self._arm(now, effects)
        if isinstance(opened, ManifestRejected) and opened.reason in _NOT_THE_HOLDERS:
            return self._not_for_us(now, peer, version, frame, opened, asked_at, effects)
        return self._arm(now, effects) + self.manifest_failed(now, peer, version, FetchFailure.CORRUPT, asked_at)

    def _not_for_us(self, now: float, peer: str, version: int, frame: bytes, why: ManifestRejected,
                    asked_at: float | None, effects: list[Any]) -> list[Any]:
        """The sound manifest of `version` that `peer` answered our ask (made at `asked_at`) with is
        one we will not take (`manifest_answer`): the ask failed, with no verdict on `peer`; another
        holder that named the version is asked at once. One signed by a publisher we do not trust
        is remembered as one our store refused: a `Holding` naming it asks for it no more, nor is
        its frame opened."""
        if why.reason == "untrusted_publisher":
            self._refused_manifests[blake3.blake3(frame).digest()] = version
            while len(self._refused_manifests) > MAX_REFUSED_MANIFESTS:
                self._refused_manifests.popitem(last=False)
        self._failed_blameless(now, peer, version, asked_at, effects)
        return self._arm(now, effects)

    def manifest_declined(self, now: float, peer: str, version: int, asked_at: float | None = None) -> list[Any]:
        """`peer` answered our `FetchManifest` of `version` (made at `asked_at`) with a status we do
        not know (`relay.role`): a newer peer's, which may add statuses as `p2pnet.wire`'s rule adds
        fields, so it says nothing we can read, neither "not held" (which would exclude it) nor a
        broken answer (a ban). The ask failed with no verdict on `peer`: another holder that named
        the version is asked at once, and `peer` stays usable but, for this version, counts as
        excluded for `exclude_s`, as "not held" would exclude it (`_usable_for`; the last
        `MAX_DECLINED` per version): liars answering so and naming it again at once, never
        excluded, kept the holders remembered full, an honest member out, and were asked for ever
        (17 members: 65 asks in 90 s, the honest one never)."""
        effects: list[Any] = []
        if self._failed_blameless(now, peer, version, asked_at, effects):
            declined = self._manifest_others.setdefault(version, _Others()).declined
            declined.pop(peer, None)
            declined[peer] = now
            if len(declined) > MAX_DECLINED:
                del declined[next(iter(declined))]
        return self._arm(now, effects)

    def _failed_blameless(self, now: float, peer: str, version: int, asked_at: float | None,
                          effects: list[Any]) -> bool:
        """The ask of `version` of `peer` (made at `asked_at`), if it is the ask in flight, failed
        with no verdict on `peer`: another holder that named the version is asked at once;
        whether it was the ask in flight."""
        asked = self._manifest_asked.get(version)
        if asked is None or asked.peer != peer or asked_at not in (None, asked.at) or version in self._versions:
            return False
        self._failed(now, version, asked, blamed=False)
        if not self._ask_another(now, version, effects) and not self._put_off(version):
            self._ask_when_usable(now, version)
        return True

    def _failed(self, now: float, version: int, asked: _Ask, blamed: bool = True) -> None:
        """The ask of `version` in flight, `asked`, failed: remembered so, and when its holder's
        ask last failed (`_rank`; the last `MAX_FAILED_ASKS` peers, the first failed forgotten
        first). A failure that is not its holder's fault (`blamed` False: `not_admitted` or
        `no_address` when it is to be asked again, a sound manifest we will not take, a status we
        do not know) is excused once, and ranks it as before (`_manifest_excused`: peer -> that
        version, the last `MAX_FAILED_ASKS` peers; a manifest it answered clears it): ranked as
        failed now, a member refused once as not admitted was asked only after every identity that
        never failed, and never while fresh ones came faster than asks (60 liars, 2 fresh per
        second: not in 300 s; excused, at 75 s, once each settled liar was). Excused only once, for
        the holder decides these failures: a liar naming the version again and again and failing
        so is then ranked as any failure ranks it; and for that version it stands in line as a
        member that joined since (`_settled`), so settled liars that fail so are not asked twice
        before a member that joined since, or one the places kept out meanwhile. (A timeout while
        our own link was down is no failure of the holder's at all: `relay.manifest_asks`' `_offline`.)"""
        self._manifest_asked[version] = asked._replace(failed=True)
        excused = self._manifest_excused
        if not blamed and asked.peer not in excused:
            excused[asked.peer] = version
            if len(excused) > MAX_FAILED_ASKS:
                del excused[next(iter(excused))]
            return
        failed_at = self._manifest_failed_at
        failed_at.pop(asked.peer, None)
        failed_at[asked.peer] = now
        if len(failed_at) > MAX_FAILED_ASKS:
            del failed_at[next(iter(failed_at))]

    def _refused_us(self, now: float, peer: str, effects: list[Any]) -> bool:
        """`peer` refused our manifest ask as not admitted: one refusal, counted with its refusals
        of chunks and as they are (`relay.failures`: excluded for `not_admitted_s`, the asks that
        failed at once with it counted once); whether to ask it again, that is, unless it has
        refused us `NOT_ADMITTED_TRIES` times in a row (it is then excluded as unreachable)."""
        if self._excluded.get(peer, 0.0) <= now:
            self._refused[peer] = refusals = self._refused.get(peer, 0) + 1
            why = DropReason.NOT_ADMITTED if refusals < NOT_ADMITTED_TRIES else DropReason.UNREACHABLE
            self._exclude(now, peer, why, effects)
        return self._refused.get(peer, 0) < NOT_ADMITTED_TRIES

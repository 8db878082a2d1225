"""Members' standing for manifest asks, and our own link (`relay.manifest_standing`): settled
takes `SETTLE_S` in our membership and survives our restart (`members_seen`, `recall_members`,
`relay.member_record` on disk); a timeout while our own link was down says nothing of the holder
(`relay.manifest_asks`' `_offline`). The core alone, in virtual time."""

from __future__ import annotations

import json

import pytest

from relay import member_record
from relay.effects import Fetch, FetchFailure
from relay.manifest_asks import MAX_ASKS_AFTER_FAILURES, MAX_OFFLINE
from relay.manifest_standing import MAX_RECALLED
from relay.messages import HeldVersion, Holding, ManifestAnnounce
from relay.transfer import TransferCore
from simulations.broadcast import fake_manifest
from tests.relay.test_manifest_holders import CONFIG, _asked, _core, asks, failed
from tests.relay.test_manifest_liars import _liars_and_an_honest_member
from tests.relay.test_transfer import PUBLISHER, SIGNED, envelope, opener

LIARS = [f"l{i:02d}" for i in range(20)]


def _named_before_h(log: list[tuple[float, str]]) -> tuple[list[str], float]:
    """The liars asked before h, and when h was first asked."""
    first = next(t for t, who in log if who == "h")
    return [who for t, who in log if t <= first and who not in ("h", "h named")], first


def test_an_identity_whose_first_heartbeat_came_just_before_a_version_is_not_settled_for_it():
    """Liar identities whose heartbeats first reached us just before a version was first asked
    for, naming it first and answering "not held", stand in line behind a member of long standing
    that names it after them: one heartbeat settled them before (h asked after the ten that named
    it before it; now the first the bound on asks after failures allows once it named it)."""
    c = _core(("h",))  # h: a member for `SETTLE_S` at 0 s
    c.set_members(0.0, {**c._members.uploads, **{liar: 1e9 for liar in LIARS}})  # their first heartbeats
    log = _liars_and_an_honest_member(LIARS, first_at=0.5, until_s=120.0, core=c)
    asked_before = [who for t, who in log if t < 0.5 and who not in ("h", "h named")]
    before, first = _named_before_h(log)
    assert before == asked_before and len(before) == 1 + MAX_ASKS_AFTER_FAILURES  # (to `_spend`'s bound)
    assert first == 5.05  # (the first ask the bound allows)


def _restarted(tmp_path, recall: bool) -> TransferCore:
    """A core that ran with h a member since -2000 s kept its record on disk (`relay.member_record`)
    at -400 s and stopped; restarted at -310 s (given the record back if `recall`), the liars'
    heartbeats reach it at once, h's 30 s later."""
    before = TransferCore(CONFIG, "me", open_frame=opener, self_upload_bps=1e8)
    before.set_members(-2000.0, {PUBLISHER.peer_id: 1e9, "me": 1e8, "h": 1e9})
    path = tmp_path / member_record.MEMBERS_FILE
    member_record.save(path, before.members_seen(-400.0))
    c = TransferCore(CONFIG, "me", open_frame=opener, self_upload_bps=1e8)
    if recall:
        assert c.recall_members(-310.0, member_record.load(path)) == []
    uploads = {PUBLISHER.peer_id: 1e9, "me": 1e8, **{liar: 1e9 for liar in LIARS}}
    c.set_members(-310.0, uploads)
    c.set_members(-280.0, {**uploads, "h": 1e9})
    return c


@pytest.mark.parametrize("recall", [True, False])
def test_a_member_of_long_standing_whose_heartbeat_comes_after_liars_after_our_restart_stays_settled(tmp_path, recall):
    """After our restart, liars' heartbeats reach us first and h's 30 s later; a version is first
    asked for `SETTLE_S` after that. Without the record on disk the liars are settled and h is a
    newcomer: h waits behind every liar (20); with it, h is settled since before our restart, and
    only the liars that named the version before it are asked first (10)."""
    log = _liars_and_an_honest_member(LIARS, first_at=0.5, until_s=120.0, core=_restarted(tmp_path, recall))
    before, _ = _named_before_h(log)
    if recall:
        assert before == LIARS[:len(before)] and len(before) <= 11  # (those that named it before h)
    else:
        assert sorted(before) == LIARS  # (what the record is for)


def test_the_record_of_members_is_bounded_and_one_not_written_by_save_is_named_unreadable(tmp_path):
    path = tmp_path / member_record.MEMBERS_FILE
    assert member_record.load(path) == {}  # a first start
    ages = {f"p{i}": float(i) for i in range(MAX_RECALLED + 1)}
    member_record.save(path, ages)
    loaded = member_record.load(path)
    assert len(loaded) == MAX_RECALLED and "p0" not in loaded and loaded["p1"] == 1.0
    c = _core()
    c.recall_members(0.0, ages)
    assert len(c._member_recalled) == MAX_RECALLED
    for text in ("{", json.dumps({"members": {"p": "x"}}), json.dumps({"members": {"p": -1}}), "[]"):
        path.write_text(text)
        with pytest.raises(member_record.MemberRecordUnreadable):
            member_record.load(path)


def test_a_recalled_member_counts_its_time_only_if_back_within_recall_s():
    c = _core()
    c.recall_members(0.0, {"a": 1000.0, "b": 1000.0})
    c.set_members(10.0, {**c._members.uploads, "a": 1e9})
    assert c._member_since["a"] == -1000.0
    c.set_members(700.0, {**c._members.uploads, "b": 1e9})  # (after `RECALL_S`: it may have left meanwhile)
    assert c._member_since["b"] == 700.0


@pytest.mark.parametrize("back_by", ["tick", "holding"])
def test_a_timeout_while_our_own_link_was_down_does_not_pass_the_holder_over(back_by):
    """h names a version and is asked; our link goes down at once and nothing comes from anyone
    meanwhile. h's ask times out (10 s): it is asked again, first in line (on the tick, 12 s, or
    at a liar's `Holding` once our link is back, 11 s), not excluded and ranked behind every liar
    (before: excluded, ranked, and the liar asked)."""
    c = _core(("h", *LIARS))
    assert asks(c, 0.0, "h") == ["h"]
    assert failed(c, 10.0, "h", FetchFailure.UNREACHABLE) == []  # nothing heard since the ask
    if back_by == "tick":
        assert _asked(c.on_timer(12.0, "relay/tick")) == ["h"]
    else:
        assert asks(c, 11.0, "l05") == ["h"]
    assert c._rank("h") == float("-inf") and "h" not in c._excluded


def test_a_holder_that_times_out_while_the_link_is_up_is_passed_over():
    """The same, but a liar's `Holding` came at 4 s: our link was up, h is judged (excluded),
    and the liar asked at once."""
    c = _core(("h", *LIARS))
    assert asks(c, 0.0, "h") == ["h"]
    assert asks(c, 4.0, "l00") == []
    assert failed(c, 10.0, "h", FetchFailure.UNREACHABLE) == ["l00"]
    assert "h" in c._excluded


def test_a_holder_that_never_answers_in_a_network_quiet_that_long_is_excused_at_most_max_offline_times():
    """Nothing comes from anyone after 0 s, and m0, asked, never answers: its timeouts are
    taken for our link being down `MAX_OFFLINE` times, then it is judged, and m1 asked."""
    c = _core(("m0", "m1"))
    assert asks(c, 0.0, "m0") == ["m0"]
    assert asks(c, 0.0, "m1") == []
    t, order = 10.0, ["m0"]
    for _ in range(2 * MAX_OFFLINE + 2):
        nxt = failed(c, t, order[-1], FetchFailure.UNREACHABLE)
        if not nxt:
            nxt = _asked(c.on_timer(t + CONFIG.not_admitted_s, "relay/tick"))
        order += nxt
        if order[-1] == "m1":
            break
        t += 12.0
    assert order == ["m0"] * (MAX_OFFLINE + 1) + ["m1"]


def test_an_ask_found_unanswered_by_the_first_holding_after_our_link_was_down_asks_the_holder_again():
    """h is asked at 0 s and nothing comes from anyone until a liar's `Holding` at 7 s (our link
    was down, and back before the shell's timeout): h's ask, unanswered for `manifest_retry_s`,
    is not taken as h's failure; h is asked again at once (before: failed, ranked, the liar asked)."""
    c = _core(("h", *LIARS))
    assert asks(c, 0.0, "h") == ["h"]
    assert asks(c, 7.0, "l05") == ["h"]
    assert c._rank("h") == float("-inf") and list(c._manifest_others[1].named) == ["l05"]


@pytest.mark.parametrize("heard", ["chunk", "answer", None])
def test_a_holder_that_times_out_while_only_chunks_or_other_answers_reach_us_is_passed_over(heard):
    """Version 1 is in flight and another ask (version 3, of g) went out before h's; h names
    version 2 and is asked at 0 s (m names it then too), and the one frame that reaches us before
    h's ask times out (10 s) is a chunk of version 1 or g's answer to our other ask (3 s): no
    message came, but our link was up, so h is judged (excluded) and m asked at once. With that
    frame not heard (`relay.manifest_standing`, `_hear`), the timeout was taken for our link
    being down, as when nothing comes (None): h not excluded, asked again later, m not yet."""
    c = _core(("h", "g", "m"))
    fetches = [e for e in c.on_message(-2.0, envelope(PUBLISHER.peer_id, ManifestAnnounce(SIGNED.frame)))
               if isinstance(e, Fetch)]
    second, third = (fake_manifest(PUBLISHER, 2**20, 2**20, version=v) for v in (2, 3))

    def names(now: float, sender: str, signed) -> list[str]:
        held = Holding((HeldVersion(signed.manifest.version, signed.manifest_id),))
        return _asked(c.on_message(now, envelope(sender, held)))

    assert names(-1.0, "g", third) == ["g"]
    assert names(0.0, "h", second) == ["h"]
    assert names(0.0, "m", second) == []  # (remembered: h's ask is in flight)
    if heard == "chunk":
        c.fetched(3.0, fetches[0].peer, 1, fetches[0].index, 0.01, 0.0)
        assert c._versions[1].have[fetches[0].index]
    elif heard == "answer":
        c.manifest_answer(3.0, "g", 3, third.frame)
        assert c.knows(3)
    if heard is None:
        assert failed(c, 10.0, "h", FetchFailure.UNREACHABLE, version=2) == []
        assert "h" not in c._excluded
    else:
        assert failed(c, 10.0, "h", FetchFailure.UNREACHABLE, version=2) == ["m"]
        assert "h" in c._excluded


def test_frames_that_come_with_the_timeout_say_nothing_of_our_link_while_the_ask_waited():
    """Version 1 is in flight; h names version 2 and is asked at 0 s (m names it then too), and
    nothing reaches us until 10 s, when two chunks of version 1 come in the same instant as h's
    ask times out: our link is back now, but nothing came while the ask waited, so the timeout
    is taken for our link being down (`_link_silent`: the frames at the timeout's own time left
    out): h is not excluded and m not asked. With the second frame of an instant counted as heard
    before it (`_hear`), h was judged and m asked."""
    c = _core(("h", "m"))
    fetches = [e for e in c.on_message(-2.0, envelope(PUBLISHER.peer_id, ManifestAnnounce(SIGNED.frame)))
               if isinstance(e, Fetch)]
    second = fake_manifest(PUBLISHER, 2**20, 2**20, version=2)
    held = Holding((HeldVersion(2, second.manifest_id),))
    assert _asked(c.on_message(0.0, envelope("h", held))) == ["h"]
    assert _asked(c.on_message(0.0, envelope("m", held))) == []
    for fetch in fetches[:2]:
        c.fetched(10.0, fetch.peer, 1, fetch.index, 0.01, 0.0)
    assert failed(c, 10.0, "h", FetchFailure.UNREACHABLE, version=2) == []
    assert "h" not in c._excluded

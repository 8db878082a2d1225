"""The relay role's record on disk of how long its members have been members (`relay.member_record`,
`relay.role_members`' `_recall_members` / `_keep_members`), through the role's real shell in virtual
time (MockClock): its core, runner and membership loop (`_follow_members`) over a peer table that
holds the relay members we choose.

A member settled before our restart is settled after it, even when its heartbeat reaches us after
our restart later than others'; a record torn or not written by us is logged and the role starts
without it; a save that fails leaves the previous record whole; a slow disk does not hold up the
membership the core plans with.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

import relay.member_record as member_record
from relay.manifest_standing import MAX_RECALLED, SETTLE_S
from relay.member_record import MEMBERS_FILE, SAVE_EVERY_S
from relay.role import RelayRole
from tests.relay.test_role_store_faults import FakeNode, start_shell

OLD = "12D3KooWold-member"
LIAR = "12D3KooWliar"


@pytest.fixture
def clock():
    return trio.testing.MockClock(autojump_threshold=0)


class Disk:
    """The role's worker-thread calls, run in the trio thread (virtual time does not race real
    threads); a write of the record waits for `writes` to be set (a slow disk) when it is not."""

    def __init__(self) -> None:
        self.writes = trio.Event()
        self.writes.set()
        self.writing = False

    async def run_sync(self, fn, *args, **kwargs):
        await trio.lowlevel.checkpoint()
        if fn is member_record.save:
            self.writing = True
            await self.writes.wait()
            self.writing = False
        return fn(*args)


@pytest.fixture
def disk(monkeypatch) -> Disk:
    disk = Disk()
    monkeypatch.setattr(trio.to_thread, "run_sync", disk.run_sync)
    return disk


class Table:
    """The peer table as `serving_uploads` reads it: the relay members in `members`."""

    def __init__(self) -> None:
        self.members: set[str] = set()
        self.local = SimpleNamespace(capacity=SimpleNamespace(upload_bps=10**8), reachable=True)
        self.penalise = lambda now, peer, amount: []

    def with_role(self, role: str) -> list[SimpleNamespace]:
        assert role == "relay"
        return [SimpleNamespace(peer_id=p, can_serve=True, reachable=True, capacity=SimpleNamespace(upload_bps=10**8))
                for p in sorted(self.members)]


def make_role(data_dir: Path) -> tuple[RelayRole, Table]:
    node = FakeNode(data_dir)
    table = Table()
    node.peertable = table
    return RelayRole(node, {"fsync": False}), table


async def follow(role: RelayRole, nursery: trio.Nursery) -> None:
    await start_shell(role, role.node, nursery)
    nursery.start_soon(role._follow_members)


def join(role: RelayRole, table: Table, peer: str) -> None:
    table.members.add(peer)
    role._members_changed.set()  # (what the node's PeerJoined does: `_on_node_event`)


def seen(role: RelayRole) -> dict[str, float]:
    return role.core.members_seen(trio.current_time())


@pytest.mark.parametrize("record", [True, False])
async def test_a_member_settled_before_our_restart_is_settled_after_it(tmp_path: Path, clock, disk, record: bool) -> None:
    """OLD is our member for longer than SETTLE_S, we restart: its heartbeat reaches us 30 s
    after a liar's; it still counts its time before the restart (without the record it would be
    a newcomer, as the liar is)."""
    data_dir = tmp_path / "relay"
    async with trio.open_nursery() as nursery:
        first, table = make_role(data_dir)
        join(first, table, OLD)
        await follow(first, nursery)
        await trio.sleep(SETTLE_S + 2 * SAVE_EVERY_S)
        assert seen(first)[OLD] >= SETTLE_S
        nursery.cancel_scope.cancel()  # our relay stops (a crash: nothing more is written)
    path = data_dir / MEMBERS_FILE
    assert member_record.load(path)[OLD] >= SETTLE_S
    assert [p.name for p in data_dir.iterdir() if p.name.startswith(f".{MEMBERS_FILE}")] == []  # no temp file left
    if not record:
        path.unlink()
    async with trio.open_nursery() as nursery:
        second, table = make_role(data_dir)
        join(second, table, LIAR)
        await follow(second, nursery)
        await trio.sleep(30.0)
        join(second, table, OLD)
        await trio.sleep(2.0)
        ages = seen(second)
        assert ages[LIAR] < 40.0
        if record:
            assert ages[OLD] >= SETTLE_S + 30.0  # its time before our restart, and since
        else:
            assert ages[OLD] < 5.0
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("text", [b'{"members": {"12D3KooWold-member": 3', b"\xff\xfe garbage", b'["members"]',
                                  b'{"members": {"x": -1}}', b'{"members": {"x": "NaN"}}', None])
async def test_a_torn_or_foreign_record_at_start_is_logged_and_the_role_starts_without_it(
        tmp_path: Path, clock, disk, caplog, text: bytes | None) -> None:
    data_dir = tmp_path / "relay"
    data_dir.mkdir()
    path = data_dir / MEMBERS_FILE
    if text is None:
        path.mkdir()  # (not even a file: the OSError of reading it)
    else:
        path.write_bytes(text)
    caplog.set_level(logging.WARNING, logger="relay.role")
    async with trio.open_nursery() as nursery:
        role, table = make_role(data_dir)
        join(role, table, OLD)
        await follow(role, nursery)
        await trio.sleep(2.0)
        assert seen(role)[OLD] < 5.0  # a newcomer, as after a first start
        assert role.core._member_recalled == {}
        assert any("record of our members is unreadable" in r.getMessage() for r in caplog.records)
        nursery.cancel_scope.cancel()


async def test_a_save_that_fails_leaves_the_previous_record_and_is_tried_again(
        tmp_path: Path, clock, disk, caplog, monkeypatch) -> None:
    data_dir = tmp_path / "relay"
    path = data_dir / MEMBERS_FILE
    real_replace = member_record.os.replace
    failing = [True]

    def replace(src, dst):
        if failing[0]:
            raise OSError(28, "No space left on device")  # (or a crash here: the rename never came)
        real_replace(src, dst)

    caplog.set_level(logging.WARNING, logger="relay.role")
    async with trio.open_nursery() as nursery:
        role, table = make_role(data_dir)
        join(role, table, OLD)
        await follow(role, nursery)
        await trio.sleep(SAVE_EVERY_S + 5.0)
        before = member_record.load(path)
        assert 0 < before[OLD] < SETTLE_S
        monkeypatch.setattr(member_record.os, "replace", replace)
        await trio.sleep(2 * SAVE_EVERY_S)
        assert member_record.load(path) == before  # the record as it was, whole
        assert any("could not keep the record of our members" in r.getMessage() for r in caplog.records)
        failing[0] = False
        await trio.sleep(SAVE_EVERY_S + 5.0)
        assert member_record.load(path)[OLD] > before[OLD] + 2 * SAVE_EVERY_S  # tried again, and kept
        nursery.cancel_scope.cancel()


async def test_a_slow_disk_does_not_hold_up_our_membership(tmp_path: Path, clock, disk) -> None:
    """The record is written in a worker thread; while a write hangs on our disk the membership the
    core plans with still follows the peer table."""
    disk.writes = trio.Event()  # every write of the record hangs until set
    async with trio.open_nursery() as nursery:
        role, table = make_role(tmp_path / "relay")
        join(role, table, OLD)
        await follow(role, nursery)
        while not disk.writing:
            await trio.sleep(1.0)
        join(role, table, LIAR)
        await trio.sleep(5.0)
        assert LIAR in role.core._members.uploads
        disk.writes.set()
        await trio.sleep(1.0)
        assert member_record.load(tmp_path / "relay" / MEMBERS_FILE)[OLD] >= SAVE_EVERY_S
        nursery.cancel_scope.cancel()


async def test_the_record_holds_the_longest_standing_members_up_to_its_bound(tmp_path: Path, clock, disk) -> None:
    """More relay members than the record holds (`MAX_RECALLED`): 100 of long standing, then
    `MAX_RECALLED` newcomers. The record written holds `MAX_RECALLED` of them, every member of long
    standing among them. At our restart a longer record (one we did not write: a hand edit, an
    older bound) is recalled only to the bound, the longest first: the members of long standing
    count their time before the restart, the newcomers cut off count none."""
    data_dir = tmp_path / "relay"
    path = data_dir / MEMBERS_FILE
    old = [f"12D3KooWold{i:03d}" for i in range(100)]
    new = [f"12D3KooWnew{i:05d}" for i in range(MAX_RECALLED)]
    async with trio.open_nursery() as nursery:
        first, table = make_role(data_dir)
        table.members.update(old)
        await follow(first, nursery)
        await trio.sleep(SAVE_EVERY_S + 10.0)
        table.members.update(new)
        first._members_changed.set()
        await trio.sleep(SAVE_EVERY_S)  # (the second write: at 120 s)
        written = json.loads(path.read_text())["members"]
        assert len(written) == MAX_RECALLED and set(old) <= set(written)
        assert all(written[p] >= 2 * SAVE_EVERY_S for p in old)
        nursery.cancel_scope.cancel()
    cut = [f"12D3KooWcut{i:03d}" for i in range(100)]
    longer = {**{p: 1000.0 for p in old}, **{p: 500.0 for p in new}, **{p: 10.0 for p in cut}}
    path.write_text(json.dumps({"members": longer}))
    async with trio.open_nursery() as nursery:
        second, table = make_role(data_dir)
        table.members.update(old + cut)
        await follow(second, nursery)
        await trio.sleep(2.0)
        ages = seen(second)
        assert all(ages[p] >= 1000.0 for p in old) and all(ages[p] < 5.0 for p in cut)
        assert len(second.core._member_recalled) == MAX_RECALLED - len(old)  # (the newcomers, not back yet)
        nursery.cancel_scope.cancel()

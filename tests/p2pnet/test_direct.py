"""Direct frames (`p2pnet.direct`): one kept stream per peer, frames in order, a broken or idle
stream replaced, a half-written frame never followed on the same stream, bad frames refused.
The first tests run real libp2p hosts over real TCP; the rest drive the two halves with stand-in
streams, to reach the failures a real connection shows only by chance."""

from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from p2pnet import direct
from p2pnet.direct import KeptStreams, receive_frames
from p2pnet.errors import PeerUnavailable
from p2pnet.host import MSG_PROTOCOL, open_host
from p2pnet.identity import Identity


class Pair:
    """Two connected hosts, a and b; b keeps every frame it receives in `got`. With `hold` set,
    b's handler takes the first frame and then waits for it, reading nothing more meanwhile."""

    def __init__(self, a, b) -> None:
        self.a, self.b = a, b
        self.got: list[tuple[bytes, str]] = []
        self.hold: trio.Event | None = None
        self._changed = trio.Event()
        b.set_frame_handler(self._on_frame)

    async def _on_frame(self, frame: bytes, source: str) -> None:
        self.got.append((frame, source))
        self._changed.set()
        self._changed = trio.Event()
        if self.hold is not None and len(self.got) == 1:
            await self.hold.wait()

    async def received(self, n: int) -> list[bytes]:
        """The frames once b holds `n` of them (a deadline, not a count of polls)."""
        with trio.fail_after(60):
            while len(self.got) < n:
                await self._changed.wait()
        return [f for f, _ in self.got]


@asynccontextmanager
async def pair(tag: str):
    async with open_host(Identity.from_seed_text(f"{tag}-a"), "/ip4/127.0.0.1/tcp/0") as a, \
            open_host(Identity.from_seed_text(f"{tag}-b"), "/ip4/127.0.0.1/tcp/0") as b:
        await a.connect(b.addrs()[0])
        yield Pair(a, b)


async def test_frames_to_one_peer_arrive_in_order_over_one_stream():
    async with pair("direct-order") as p:
        for k in range(30):
            await p.a.send_frame(p.b.peer_id, b"frame %d" % k)
        assert await p.received(30) == [b"frame %d" % k for k in range(30)]
        assert {s for _, s in p.got} == {p.a.peer_id} and p.a._direct.opened == 1


async def test_a_kept_stream_that_broke_is_replaced_and_the_frame_still_arrives():
    async with pair("direct-broken") as p:
        await p.a.send_frame(p.b.peer_id, b"one")
        await p.received(1)
        await p.a._direct._kept[p.b.peer_id].stream.reset()  # as a connection that went would leave it
        await p.a.send_frame(p.b.peer_id, b"two")
        assert await p.received(2) == [b"one", b"two"] and p.a._direct.opened == 2


async def test_a_stream_idle_past_the_senders_limit_is_replaced_not_written_on(monkeypatch):
    monkeypatch.setattr(direct, "OUTBOUND_IDLE_S", 0.2)  # (the receiver's limit stays far off)
    async with pair("direct-idle") as p:
        await p.a.send_frame(p.b.peer_id, b"one")
        await p.received(1)
        await trio.sleep(0.3)  # idle past the sender's limit
        await p.a.send_frame(p.b.peer_id, b"two")
        assert await p.received(2) == [b"one", b"two"] and p.a._direct.opened == 2


async def test_a_stream_carrying_one_frame_and_closed_is_still_received():
    from libp2p.peer.id import ID

    async with pair("direct-oneshot") as p:
        stream = await p.a._host.new_stream(ID.from_base58(p.b.peer_id), [MSG_PROTOCOL])
        await stream.write(len(b"alone").to_bytes(4, "big") + b"alone")
        await stream.close()
        assert await p.received(1) == [b"alone"] and p.got[0][1] == p.a.peer_id


# -- the halves, with stand-in streams -----------------------------------------------------------


class FakeStream:
    """A stream that records what is written; `block_after` bytes in, a write blocks forever
    (a full window); `fail` makes every write raise, as a reset or dead connection does."""

    def __init__(self, block_after: int | None = None, fail: bool = False) -> None:
        self.written = b""
        self.block_after = block_after
        self.fail = fail
        self.reset_called = self.closed = False

    async def write(self, data: bytes) -> None:
        if self.fail:
            raise ConnectionResetError("reset by peer")
        if self.block_after is not None and len(self.written) + len(data) > self.block_after:
            self.written += data[: self.block_after - len(self.written)]
            await trio.sleep_forever()
        self.written += data
        await trio.lowlevel.checkpoint()

    async def reset(self) -> None:
        self.reset_called = True

    async def close(self) -> None:
        self.closed = True


def opener(streams: list):
    opened: list = []

    async def open_stream(peer: str):
        await trio.lowlevel.checkpoint()
        if not streams:
            raise OSError("connection refused")
        opened.append((peer, streams[0]))
        return streams.pop(0)

    return open_stream, opened


async def test_a_write_cut_off_by_the_timeout_ends_that_stream_and_the_next_frame_takes_a_new_one():
    first, second = FakeStream(block_after=6), FakeStream()
    open_stream, opened = opener([first, second])
    kept = KeptStreams(open_stream)
    with pytest.raises(PeerUnavailable, match="within"):
        await kept.send("p", b"0123456789", timeout_s=0.05)
    assert len(first.written) == 6 and first.closed and not first.reset_called  # half a frame out: ended
    await kept.send("p", b"next", timeout_s=5)
    assert second.written == b"\x00\x00\x00\x04next" and [s for _, s in opened] == [first, second]


async def test_a_kept_stream_that_fails_is_retried_once_on_a_new_one_and_a_new_one_failing_is_the_peers_fault():
    good = FakeStream()
    open_stream, opened = opener([good])
    kept = KeptStreams(open_stream)
    await kept.send("p", b"a", timeout_s=5)
    good.fail = True
    with pytest.raises(PeerUnavailable, match="refused"):  # the retry's open fails: no stream left
        await kept.send("p", b"b", timeout_s=5)
    assert good.closed and "p" not in kept._kept  # a peer we hold no stream to is not remembered
    broken = FakeStream(fail=True)
    open_stream, _ = opener([broken])
    with pytest.raises(PeerUnavailable, match="reset by peer"):
        await KeptStreams(open_stream).send("q", b"c", timeout_s=5)


class SlowStream(FakeStream):
    """Writes in two halves with a scheduling point between (unlocked, frames would interleave);
    with `gate` set, a write of a frame holding `gate_on` waits for the gate between its halves,
    and `halfway` tells when one is there."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: trio.Event | None = None
        self.gate_on = b""
        self.halfway = trio.Event()

    async def write(self, data: bytes) -> None:
        half = len(data) // 2
        self.written += data[:half]
        if self.gate is not None and self.gate_on in data:
            self.halfway.set()
            await self.gate.wait()
        await trio.lowlevel.checkpoint()
        self.written += data[half:]


def frames_in(wire: bytes) -> list[bytes]:
    out = []
    while wire:
        n = int.from_bytes(wire[:4], "big")
        out.append(wire[4:4 + n])
        wire = wire[4 + n:]
    return out


async def test_concurrent_sends_to_one_peer_share_one_stream_frame_by_frame_while_others_are_evicted():
    streams = [SlowStream() for _ in range(3)]
    open_stream, opened = opener(list(streams))
    kept = KeptStreams(open_stream, max_kept=1)
    async with trio.open_nursery() as nursery:
        for k in range(5):
            nursery.start_soon(partial(kept.send, "p", b"frame %d" % k, timeout_s=5.0))
    assert sorted(frames_in(streams[0].written)) == [b"frame %d" % k for k in range(5)] and len(opened) == 1
    streams[0].gate, streams[0].gate_on = trio.Event(), b"late"
    async with trio.open_nursery() as nursery:  # q's send would evict p's stream, but not while p's write holds it
        nursery.start_soon(partial(kept.send, "p", b"late", timeout_s=5.0))
        await streams[0].halfway.wait()
        await kept.send("q", b"other", timeout_s=5.0)
        assert not streams[0].closed
        streams[0].gate.set()
    assert frames_in(streams[0].written)[-1] == b"late" and not streams[0].closed
    assert frames_in(streams[1].written) == [b"other"] and len(kept) == 2
    await kept.send("r", b"third", timeout_s=5.0)  # nothing in use: back to one, the others closed
    assert streams[0].closed and streams[1].closed and len(kept) == 1 and frames_in(streams[2].written) == [b"third"]


async def test_at_most_max_kept_streams_stay_open_the_least_recently_used_closed_first():
    streams = [FakeStream() for _ in range(4)]
    open_stream, opened = opener(list(streams))
    kept = KeptStreams(open_stream, max_kept=2)
    await kept.send("p1", b"x", timeout_s=5)
    await kept.send("p2", b"x", timeout_s=5)
    await kept.send("p1", b"x", timeout_s=5)  # p2 is now the least recently used
    await kept.send("p3", b"x", timeout_s=5)
    assert streams[1].closed and not streams[0].closed and len(kept) == 2
    assert sorted(p for p, k in kept._kept.items() if k.stream is not None) == ["p1", "p3"]
    for peer in ("p1", "p3") * 3:  # peers that hold streams already evict nobody
        await kept.send(peer, b"x", timeout_s=5)
    assert len(opened) == 3 and not streams[0].closed and not streams[2].closed


class FeedStream:
    """An inbound stream that hands out `chunks` one read at a time, then stalls or ends."""

    def __init__(self, chunks: list[bytes], end: bool = True) -> None:
        self.chunks = list(chunks)
        self.end = end
        self.reset_called = self.closed = False

    async def read(self, n: int) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self.chunks:
            if self.end:
                return b""
            await trio.sleep_forever()
        data, rest = self.chunks[0][:n], self.chunks[0][n:]
        self.chunks[0:1] = [rest] if rest else []
        return data

    async def reset(self) -> None:
        self.reset_called = True

    async def close(self) -> None:
        self.closed = True


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


async def test_the_receiver_hands_on_frames_split_anyhow_in_order_until_the_stream_ends():
    got: list = []

    async def handler(f: bytes, peer: str) -> None:
        got.append((f, peer))

    wire = frame(b"first") + frame(b"") + frame(b"third")
    stream = FeedStream([wire[:2], wire[2:7], wire[7:]])
    await receive_frames(stream, "peer", 1024, handler)
    assert got == [(b"first", "peer"), (b"", "peer"), (b"third", "peer")] and stream.closed


async def test_an_oversized_frame_or_one_that_stalls_midway_resets_the_stream(autojump_clock):
    got: list = []

    async def handler(f: bytes, peer: str) -> None:
        got.append(f)

    oversized = FeedStream([frame(b"ok"), frame(b"x" * 100), frame(b"never")])
    await receive_frames(oversized, "peer", 10, handler)
    assert got == [b"ok"] and oversized.reset_called
    stalled = FeedStream([frame(b"ok"), frame(b"cut short")[:7]], end=False)
    with trio.fail_after(direct.FRAME_S * 2):
        await receive_frames(stalled, "peer", 1024, handler)
    assert got == [b"ok", b"ok"] and stalled.reset_called
    idle = FeedStream([], end=False)  # nothing ever: given up after INBOUND_IDLE_S
    with trio.fail_after(direct.INBOUND_IDLE_S * 2):
        await receive_frames(idle, "peer", 1024, handler)
    assert idle.reset_called


async def test_what_the_handler_raises_is_raised_not_taken_for_the_senders_fault_and_the_stream_is_reset():
    async def handler(f: bytes, peer: str) -> None:
        raise RuntimeError("a bug of ours")

    stream = FeedStream([frame(b"x"), frame(b"y")], end=False)
    with pytest.raises(RuntimeError, match="a bug of ours"):
        await receive_frames(stream, "peer", 1024, handler)
    assert stream.reset_called  # nobody reads it any more: its sender is told


class StalledResetFeed(FeedStream):
    """An inbound stream on a connection that stalled: its reset (a frame written on that
    connection) never returns."""

    async def reset(self) -> None:
        self.reset_called = True
        await trio.sleep(3600)  # (an hour of the mock clock: an unbounded reset fails the test, never hangs it)


async def test_the_receivers_resets_on_a_stalled_connection_are_bounded(autojump_clock):
    async def handler(f: bytes, peer: str) -> None:
        if f == b"boom":
            raise RuntimeError("a bug of ours")

    cases = [  # (stream, how long the receiver may wait for the stream before it resets it)
        (StalledResetFeed([], end=False), direct.INBOUND_IDLE_S),  # idle
        (StalledResetFeed([frame(b"x" * 100)]), 0.0),  # oversized
        (StalledResetFeed([frame(b"cut short")[:7]], end=False), direct.FRAME_S),  # stalls mid-frame
    ]
    for stream, waits_s in cases:
        started = trio.current_time()
        await receive_frames(stream, "peer", 10, handler)
        assert stream.reset_called and trio.current_time() - started <= waits_s + direct.END_S + 0.1
    raising = StalledResetFeed([frame(b"boom")], end=False)
    started = trio.current_time()
    with pytest.raises(RuntimeError, match="a bug of ours"):
        await receive_frames(raising, "peer", 1024, handler)
    assert raising.reset_called and trio.current_time() - started <= direct.END_S + 0.1


class StuckStream(FakeStream):
    """A stream on a stalled connection: a write blocks once the window is full, and so do its
    close and reset (each writes a frame on that connection)."""

    async def close(self) -> None:
        self.closed = True
        await trio.sleep(3600)  # (an hour of the mock clock: a wait left unbounded fails the test, never hangs it)

    async def reset(self) -> None:
        self.reset_called = True
        await trio.sleep(3600)


async def test_a_stalled_connection_never_holds_the_send_past_its_timeout_and_a_bounded_end(autojump_clock):
    stuck = StuckStream(block_after=2)
    open_stream, _ = opener([stuck])
    kept = KeptStreams(open_stream)
    started = trio.current_time()
    with pytest.raises(PeerUnavailable, match="within"):
        await kept.send("p", b"payload", timeout_s=5.0)
    assert stuck.closed and stuck.reset_called  # the close tried, then the reset, each bounded
    assert trio.current_time() - started <= 5.0 + 2 * direct.END_S + 0.1
    assert not kept._kept  # and the peer's lock is free: nothing remembered


async def test_frames_unread_when_a_write_is_cut_off_still_reach_the_receiver():
    async with pair("direct-cut") as p:
        p.hold = release = trio.Event()  # the receiver reads nothing after the first frame: the window fills
        await p.a.send_frame(p.b.peer_id, b"f0")
        await p.received(1)
        for k in (1, 2, 3):
            await p.a.send_frame(p.b.peer_id, b"f%d" % k)
        with pytest.raises(PeerUnavailable):  # 32 MiB cannot go through a window (16 MiB at most) nobody reads
            await p.a.send_frame(p.b.peer_id, bytes(32 << 20), timeout_s=1.0)
        release.set()
        await p.a.send_frame(p.b.peer_id, b"after")
        assert await p.received(5) == [b"f0", b"f1", b"f2", b"f3", b"after"]


"""Bulk transfers on the data plane over real loopback TCP: a chunk sent with `send_file` and
received with `FrameReader.exactly_into` arrives whole (after a frame the reader buffered past),
and a transfer cut short ends with the error that names who is at fault: a deadline on a
reader that stops reading, `TruncatedStream` for a sender that goes away mid-chunk,
`trio.BrokenResourceError` for a reader that resets the connection mid-chunk."""

from __future__ import annotations

import os
import socket
import struct
from functools import partial

import pytest
import trio

from p2pnet.dataplane import FrameReader, TruncatedStream, send_file

CHUNK = (4 << 20) + 12345  # several socket buffers, and not a round size
SMALL = 64 << 10  # fits in loopback's socket buffers: sent at once, nobody reading


async def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    await listeners[0].aclose()
    return client, server


@pytest.fixture
def payload_file(tmp_path):
    data = os.urandom(CHUNK + 777)
    path = tmp_path / "payload"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def test_a_chunk_arrives_whole_after_a_frame(payload_file):
    fd, data = payload_file

    async def main():
        a, b = await _pair()
        async with a, b:
            reader = FrameReader(b, max_frame_bytes=64)
            buffer = bytearray(CHUNK + 10)
            async with trio.open_nursery() as nursery:
                async def send():
                    await a.send_all(b"\x00\x00\x00\x03abc")  # a frame first: the reader may buffer past it
                    await send_file(a, fd, 777, CHUNK)
                    await send_file(a, fd, 0, 5)
                nursery.start_soon(send)
                assert await reader.frame() == b"abc"
                got = await reader.exactly_into(CHUNK, buffer)
                assert got is buffer and bytes(buffer[:CHUNK]) == data[777:777 + CHUNK]
                assert await reader.exactly(5) == data[:5]

    trio.run(main)


def test_a_send_to_a_reader_that_stops_ends_at_its_deadline(payload_file):
    fd, _ = payload_file

    async def main():
        a, b = await _pair()
        async with a, b:
            with pytest.raises(trio.TooSlowError):
                with trio.fail_after(0.5):
                    await send_file(a, fd, 0, CHUNK)  # b never reads: the socket buffers fill

    trio.run(main)


def test_a_sender_that_goes_away_mid_chunk_is_a_truncated_stream(payload_file):
    fd, _ = payload_file

    async def main():
        a, b = await _pair()
        async with b:
            async with a:
                await send_file(a, fd, 0, SMALL)
            with pytest.raises(TruncatedStream):
                await FrameReader(b, max_frame_bytes=64).exactly_into(CHUNK)

    trio.run(main)


def test_a_reader_that_resets_mid_chunk_breaks_the_send(payload_file):
    fd, _ = payload_file

    async def main():
        a, b = await _pair()
        async with a:
            async with trio.open_nursery() as nursery:
                async def read_a_little_then_reset():
                    await FrameReader(b, max_frame_bytes=64).exactly_into(SMALL)
                    b.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    await b.aclose()
                nursery.start_soon(read_a_little_then_reset)
                with pytest.raises(trio.BrokenResourceError):
                    with trio.fail_after(60):  # a safety net only: the reset ends it at once
                        await send_file(a, fd, 0, CHUNK)

    trio.run(main)


def test_a_slow_reader_is_served_however_long_it_takes_a_stopped_one_is_cut_off(payload_file):
    """`idle_s` counts from the last bytes the reader took, not from the start: a reader that takes
    a little at a time, for longer in all than `idle_s`, gets the whole chunk; one that stops
    taking is cut off `idle_s` after its last bytes."""
    fd, data = payload_file
    idle_s = 2.0

    async def main():
        a, b = await _pair()
        a.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # small buffers: the
        b.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # reader sets the pace
        async with a, b:
            got = bytearray()
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(send_file, a, fd, 0, CHUNK, idle_s=idle_s))
                while len(got) < CHUNK:  # 64 KiB every 0.05 s: about 3.3 s for CHUNK, each gap far below idle_s
                    got += await b.receive_some(min(64 << 10, CHUNK - len(got)))
                    await trio.sleep(0.05)
            assert bytes(got) == data[:CHUNK]
            assert trio.current_time() - started > idle_s  # longer in all than idle_s

            with pytest.raises(trio.TooSlowError, match="took nothing"):
                await send_file(a, fd, 0, CHUNK, idle_s=0.3)  # b takes nothing now

    trio.run(main)

"""Hostile bytes on the peer's HTTP server (`p2pnet.web`, which `[peer] metrics_listen` may put
beyond loopback): garbage, torn and oversized requests, odd methods and paths end, at worst, in
their own connection closed; an honest scrape is answered after each batch. Seeded."""

from __future__ import annotations

import random

import trio

from p2pnet.web import WebApp, serve

SEED = 20261205
SLACK_S = 10.0


async def exchange(host: str, port: int, payload: bytes) -> bytes:
    """Send `payload` on a new connection, end our side, and read until the server closes it
    (it must, within `SLACK_S`)."""
    out = bytearray()
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        try:
            await stream.send_all(payload)
            await stream.send_eof()
            with trio.fail_after(SLACK_S):
                while data := await stream.receive_some(1 << 16):
                    out += data
        except trio.BrokenResourceError:
            pass
    return bytes(out)


async def test_garbage_requests_end_their_connection_and_honest_scrapes_go_on(nursery) -> None:
    calls = []

    async def snapshot():
        calls.append("snapshot")
        return {"leaderboard": [{"peer": "x"}]}

    app = WebApp(snapshot=snapshot, metrics=lambda: b"p2pnet_up 1\n", health=lambda: None)
    url = await nursery.start(serve, app, "127.0.0.1:0")
    host, port = url.removeprefix("http://").rsplit(":", 1)
    rng = random.Random(SEED)
    honest = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    payloads = [rng.randbytes(n) for n in (1, 16, 300, 5000, 70000)]
    payloads += [honest[:rng.randrange(len(honest))] + rng.randbytes(rng.randrange(1, 40)) for _ in range(12)]
    payloads += [
        b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # an overlong request line
        b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 10_000 + b"\r\n",  # too many headers
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 18446744073709551616\r\n\r\nabc",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"BREW /%ff%00%zz HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /api/dashboard?\xff HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/9.9\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.randbytes(64),  # an HTTP/2 preface, then garbage
    ]
    for i, payload in enumerate(payloads):
        answer = await exchange(host, int(port), payload)
        assert not answer.startswith(b"HTTP/1.1 5"), (SEED, i, answer[:80])  # no error of ours
    for path in (b"/metrics", b"/healthz", b"/api/dashboard", b"/api/leaderboard"):
        answer = await exchange(host, int(port), b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), (path, answer[:80])
    assert calls  # the JSON route ran: the app is the one serving
    nursery.cancel_scope.cancel()

"""How the peer's HTTP server (`p2pnet.web`) refuses a request body, as the protocols ask: real
sockets on loopback against the real server (`tests/p2pnet/test_web_limits.py` has the rest).

A client that asks leave before sending its body (`Expect: 100-continue`: curl for bodies over
1 MiB, many HTTP libraries always) is refused with the final status, not invited first with a
100 (Continue) it would answer with the body; and an HTTP/2 connection closed because its client
went on sending a body past the answer says so first with a GOAWAY, which tells the client which
of its streams were processed. A page that fails while such a body arrives is answered, and its
connection freed, whatever the body's pace."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
import trio
from hypercorn.logging import Logger as HypercornLogger

from p2pnet.web_limits import Limits
from tests.p2pnet.test_web_limits import (BODY_BYTES, HOLD, KEEP_ALIVE, SLACK_S, connect, read_until_closed, send_all,
                                          settle, start)

EXPECTING = [  # a request asking leave to send a body no route takes, and the status that refuses it
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % BODY_BYTES,
     b"HTTP/1.1 413 "),
    (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n" % BODY_BYTES,
     b"HTTP/1.1 405 "),
    (b"PUT /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n",
     b"HTTP/1.1 405 "),
]


GET = [(":method", "GET"), (":path", "/metrics"), (":scheme", "http"), (":authority", "x")]


def h2_client() -> h2.connection.H2Connection:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    return client


async def h2_events_until(sock: trio.socket.SocketType, client: h2.connection.H2Connection,
                          done: type[h2.events.Event] | None) -> list[h2.events.Event]:
    """What the server sends on `sock`, as `client`'s events, until one of type `done` (None: until
    the server closes the connection), within SLACK_S."""
    events: list[h2.events.Event] = []
    with trio.fail_after(SLACK_S):
        while done is None or not any(isinstance(event, done) for event in events):
            data = await sock.recv(1 << 16)
            if not data:
                assert done is None, events
                return events
            events += client.receive_data(data)
            await sock.send(client.data_to_send())  # its acknowledgements (SETTINGS)
    return events


async def test_a_request_that_expects_100_continue_is_refused_with_its_final_status_first(nursery):
    """hypercorn answered `Expect: 100-continue` with a 100 as soon as it had read the request's
    head, before the application saw it, so the client sent the body that the 413 or 405 right
    after refused (curl sent the whole of a 2 MB upload). Now the refusal is the first and only
    answer (RFC 9110 10.1.1 and 15.2.1: a server may answer with its final status instead), and
    the client sends nothing. Over HTTP/2 hypercorn sends no 100 (checked here as well)."""
    connections, port = await start(nursery, Limits(**HOLD))
    for head, status in EXPECTING:
        with await connect(port) as sock:
            await sock.send(head)  # and nothing more: the body waits for a 100
            answer = await read_until_closed(sock, SLACK_S)  # the server ends its side after a refusal
        assert answer.startswith(status) and b"connection: close" in answer, answer[:200]
        assert b" 100 " not in answer, answer[:200]
        await settle(connections, 0)

    client = h2_client()
    client.send_headers(1, GET + [("content-length", str(BODY_BYTES)), ("expect", "100-continue")])
    with await connect(port) as sock:
        await sock.send(client.data_to_send())
        events = await h2_events_until(sock, client, h2.events.StreamEnded)
    answers = [event for event in events
               if isinstance(event, (h2.events.InformationalResponseReceived, h2.events.ResponseReceived))]
    assert [type(event) for event in answers] == [h2.events.ResponseReceived], answers
    assert dict(answers[0].headers)[b":status"] == b"413"
    await settle(connections, 0)
    assert connections.failed == 0


async def test_an_http2_connection_closed_for_a_body_sent_past_its_answer_sends_a_goaway_first(nursery):
    """A DATA frame on a stream already answered (a body no route takes, undeclared, sent on after
    the response) closes the connection (`ConnectionServer._data_for_a_stream_answered`), which
    ended with no GOAWAY: a client could not tell a connection closed on purpose, its requests
    processed, from one lost (RFC 9113 6.8). It now gets a GOAWAY (NO_ERROR: sending on was no
    error of the client's; the last stream processed is its one) before the end of stream."""
    connections, port = await start(nursery, Limits(**HOLD))
    client = h2_client()
    client.send_headers(1, GET)  # and no end of stream: a body follows
    with await connect(port) as sock:
        await sock.send(client.data_to_send())
        answered = await h2_events_until(sock, client, h2.events.StreamEnded)  # the response, whole
        client.send_data(1, b"x")  # the body goes on past the answer
        await sock.send(client.data_to_send())
        events = await h2_events_until(sock, client, None)
    assert [dict(event.headers)[b":status"] for event in answered if isinstance(event, h2.events.ResponseReceived)] \
        == [b"200"]
    goaways = [event for event in events if isinstance(event, h2.events.ConnectionTerminated)]
    assert [(event.error_code, event.last_stream_id) for event in goaways] == [(h2.errors.ErrorCodes.NO_ERROR, 1)], \
        events
    await settle(connections, 0)
    assert connections.failed == 0


async def test_a_later_request_on_a_kept_alive_connection_that_expects_100_continue_is_refused_first(nursery):
    """The h11 state that never invites a body (`NoContinue`) is set once per connection, so it
    must be the one hypercorn keeps for the connection's next requests (it starts each next cycle
    on the same object): a request that asks leave to send a body, after one that did not, on a
    kept-alive connection (pipelined here: the second is read once the first is answered) is
    refused with its final status, with no 100 (Continue) between the two answers."""
    connections, port = await start(nursery, Limits(**HOLD))
    for head, status in EXPECTING:
        with await connect(port) as sock:
            await sock.send(KEEP_ALIVE + head)  # the second's body waits for a 100
            answer = await read_until_closed(sock, SLACK_S)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 ") == 2, answer
        assert status in answer and b" 100 " not in answer, answer
        await settle(connections, 0)
    assert connections.failed == 0


async def test_the_goaway_names_the_answered_stream_not_one_opened_in_the_same_read_after_its_body(nursery):
    """A body sent past the answer that ends its stream lets the client open the next one (one
    stream at a time) in the same read; hypercorn drops the rest of that read's events, so the
    next stream never reaches the application. The GOAWAY names the answered stream as the last
    processed (h2's default, the highest the client opened, would tell it that the request nobody
    saw might have been processed, which it then may not retry, RFC 9113 6.8), and the stream it
    does not name is not answered."""
    connections, port = await start(nursery, Limits(**HOLD))
    client = h2_client()
    client.send_headers(1, GET)  # and no end of stream: a body follows
    with await connect(port) as sock:
        await sock.send(client.data_to_send())
        await h2_events_until(sock, client, h2.events.StreamEnded)  # the response, whole
        client.send_data(1, b"x", end_stream=True)  # the body goes on past the answer, and ends
        client.send_headers(3, GET, end_stream=True)  # the next request, in the same write
        await sock.send(client.data_to_send())
        events = await h2_events_until(sock, client, None)
    goaways = [event for event in events if isinstance(event, h2.events.ConnectionTerminated)]
    assert [(event.error_code, event.last_stream_id) for event in goaways] == [(h2.errors.ErrorCodes.NO_ERROR, 1)], \
        events
    assert not [event for event in events if isinstance(event, h2.events.ResponseReceived)], events
    await settle(connections, 0)
    assert connections.failed == 0


async def test_a_page_failing_while_an_undeclared_http2_body_arrives_is_answered_and_its_connection_freed(
        nursery, monkeypatch):
    """A page that fails while an HTTP/2 body no header declares arrives (1-byte DATA frames: the
    most messages hypercorn's queue can be sent) is answered 500, and its connection ends (the DATA
    sent on past the answer closes it, as for any answered stream). hypercorn's own 500 came only
    once the application had returned, when nothing dropped the body any more: its reader filled
    the queue while the 500 went out, and the end of the 500's stream, which queues the request's
    end, then waited on the full queue with the reader, both until the lifetime's reset. The race
    was won by 1 or 2 of the queue's 10 places (measured), so hypercorn's error log, on that path, is
    given 10 checkpoints more here, as a slower path (another release of hypercorn) would; the page's
    own 500, sent while the body is still dropped, does not take it."""
    exception = HypercornLogger.exception

    async def slower_exception(self: HypercornLogger, message: str, *args: object, **kwargs: object) -> None:
        for _ in range(10):
            await trio.lowlevel.checkpoint()
        await exception(self, message, *args, **kwargs)

    monkeypatch.setattr(HypercornLogger, "exception", slower_exception)

    async def failing() -> dict:
        raise RuntimeError("a failing page")

    connections, port = await start(nursery, Limits(**HOLD), snapshot=failing)
    client = h2_client()
    client.send_headers(1, [(":method", "GET"), (":path", "/api/dashboard"), (":scheme", "http"),
                            (":authority", "x")])  # and no end of stream: a body follows
    while client.local_flow_control_window(1):  # the whole window, one byte a frame
        client.send_data(1, b"x")
    events: list[h2.events.Event] = []
    with await connect(port) as sock:
        async with trio.open_nursery() as sender:
            sender.start_soon(send_all, sock, client.data_to_send())  # nothing else is sent: no bytes between
            with trio.fail_after(SLACK_S):
                while data := await sock.recv(1 << 16):
                    events += client.receive_data(data)
            sender.cancel_scope.cancel()
    assert [dict(event.headers)[b":status"] for event in events if isinstance(event, h2.events.ResponseReceived)] \
        == [b"500"], events
    await settle(connections, 0)
    assert connections.failed == 0

"""The control socket: the pure request parser, error answers, and the server on in-memory streams."""

import json
import logging

import pytest
import trio
import trio.testing

from p2pnet.control import (MAX_REQUEST_BYTES, ControlServer, Reason, RequestRefused, error_answer,
                            parse_request)
from p2pnet.errors import ConfigError, LocalStateError, PeerUnavailable

COMMANDS = ("status", "checkpoint.fetch")


@pytest.mark.parametrize("line, reason", [
    (b"", Reason.EMPTY),
    (b"  \r", Reason.EMPTY),
    (b'{"cmd": "status", "x": "' + b"a" * MAX_REQUEST_BYTES + b'"}', Reason.TOO_LARGE),
    (b'{"cmd": "st\xffatus"}', Reason.NOT_UTF8),
    (b'{"cmd": "status", "x": ' + b"[" * 30000 + b"]" * 30000 + b"}", Reason.TOO_DEEP),
    (b'{"cmd": "status", "x": ' + b"[" * 17 + b"]" * 17 + b"}", Reason.TOO_DEEP),
    (b'{"cmd": "status", "x": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', None),  # brackets in a string
    (b'{"cmd": "status", "x": "\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\\\"}', None),  # after escapes
    (b'{"cmd": "status"', Reason.NOT_JSON),
    (b"{'cmd': 'status'}", Reason.NOT_JSON),
    (b'{"cmd": "status", "x": NaN}', Reason.NON_FINITE_NUMBER),
    (b'{"cmd": "status", "x": Infinity}', Reason.NON_FINITE_NUMBER),
    (b'{"cmd": "status", "x": -Infinity}', Reason.NON_FINITE_NUMBER),
    (b'{"cmd": "status", "x": 1e400}', Reason.NON_FINITE_NUMBER),
    (b'{"cmd": "status", "x": 100000000000000000000000000000}', Reason.NUMBER_OUT_OF_RANGE),
    (b'{"cmd": "status", "x": ' + b"9" * 5000 + b"}", Reason.NUMBER_OUT_OF_RANGE),
    (b'["status"]', Reason.NOT_OBJECT),
    (b'"status"', Reason.NOT_OBJECT),
    (b"{}", Reason.BAD_CMD),
    (b'{"cmd": []}', Reason.BAD_CMD),
    (b'{"cmd": {"a": 1}}', Reason.BAD_CMD),
    (b'{"cmd": 5}', Reason.BAD_CMD),
    (b'{"cmd": "stat"}', Reason.UNKNOWN_COMMAND),
])
def test_the_parser_names_every_bad_request(line, reason):
    if reason is None:
        assert parse_request(line, COMMANDS)["cmd"] == "status"
        return
    with pytest.raises(RequestRefused) as info:
        parse_request(line, COMMANDS)
    assert info.value.reason is reason
    answer = error_answer(info.value)
    assert answer["reason"] == str(reason) and answer["error"]


def test_a_good_request_is_its_object():
    line = b'{"cmd": "checkpoint.fetch", "version": 3, "out_dir": "/x", "timeout_s": 1.5}'
    assert parse_request(line, COMMANDS) == {"cmd": "checkpoint.fetch", "version": 3, "out_dir": "/x",
                                             "timeout_s": 1.5}


def test_errors_from_commands_become_answers_that_name_the_field(caplog):
    request = {"cmd": "checkpoint.fetch", "out_dir": "/srv/file/sub", "paths": ["/a/b.safetensors"]}
    cases = [
        (ConfigError("paths", "a list"), "bad_field", "paths"),
        (KeyError("version"), "missing_field", "version"),
        (ValueError("invalid literal for int()"), "bad_field", "request"),
        (NotADirectoryError(20, "Not a directory", "/srv/file/sub"), "path_error", "out_dir"),
        (FileExistsError(17, "File exists", "/srv/file/sub/x.tmp"), "path_error", "out_dir"),
        (PermissionError(13, "Permission denied", "/a/b.safetensors"), "path_error", "paths"),
        (LocalStateError("store corrupt"), "local_state", None),
        (PeerUnavailable("version 3 not complete after 1s"), "peer_unavailable", None),
    ]
    for exc, reason, field in cases:
        answer = error_answer(exc, request)
        assert answer["reason"] == reason and answer.get("field") == field, (exc, answer)
    assert not caplog.records
    with caplog.at_level(logging.ERROR, logger="p2pnet.control"):
        answer = error_answer(RuntimeError("a bug"), request)
    assert answer == {"error": "internal error: RuntimeError: a bug", "reason": "internal"}
    assert caplog.records[0].exc_info is not None  # the traceback is logged


async def ask(server: ControlServer, line: bytes) -> list[dict]:
    """Run one connection through the server on an in-memory stream; every line it answered."""
    client, end = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server._handle, end)
        await client.send_all(line)
        if not line.endswith(b"\n"):
            await client.send_eof()
        data = b""
        while chunk := await client.receive_some(65536):
            data += chunk
    return [json.loads(x) for x in data.splitlines()]


def server_with(tmp_path, **commands) -> ControlServer:
    server = ControlServer(tmp_path, queue_wait_s=1.0, max_in_flight=2)
    for name, fn in commands.items():
        server.register(name, fn)
    return server


async def test_the_server_answers_bad_requests_and_failing_commands(tmp_path, autojump_clock):
    async def fail(request, reply):
        raise NotADirectoryError(20, "Not a directory", request["out_dir"] + "/model.safetensors")

    async def crash(request, reply):
        raise ZeroDivisionError("a bug")

    async def not_a_dict(request, reply):
        return [1]

    server = server_with(tmp_path, fetch=fail, crash=crash, odd=not_a_dict)
    assert (await ask(server, b'{"cmd": []}\n'))[0]["reason"] == "bad_cmd"
    [answer] = await ask(server, b'{"cmd": "fetch", "out_dir": "/tmp/f"}\n')
    assert answer["reason"] == "path_error" and answer["field"] == "out_dir"
    assert (await ask(server, b'{"cmd": "crash"}\n'))[0]["reason"] == "internal"
    assert (await ask(server, b'{"cmd": "odd"}\n'))[0]["reason"] == "internal"
    assert (await ask(server, b'{"cmd": "fetch"'))[0]["reason"] == "not_json"  # EOF ends the line
    assert (await ask(server, b'{"cmd": "fetch", '))[0]["reason"] == "not_json"


async def test_a_silent_client_times_out_and_a_full_server_says_busy(tmp_path, autojump_clock):
    release = trio.Event()

    async def hold(request, reply):
        await release.wait()
        return {"held": True}

    server = server_with(tmp_path, hold=hold)
    async with trio.open_nursery() as nursery:
        client, end = trio.testing.memory_stream_pair()
        nursery.start_soon(server._handle, end)  # says nothing for read_timeout_s
        assert json.loads(await client.receive_some())["reason"] == "timeout"
        for _ in range(2):
            nursery.start_soon(ask, server, b'{"cmd": "hold"}\n')
        await trio.testing.wait_all_tasks_blocked()
        [answer] = await ask(server, b'{"cmd": "hold"}\n')  # both slots held for longer than queue_wait_s
        assert answer["reason"] == "busy"
        release.set()


async def test_a_client_that_leaves_mid_answer_is_not_an_error(tmp_path, autojump_clock, caplog):
    sent = trio.Event()

    async def stream(request, reply):
        await reply({"progress": {"n": 1}})
        sent.set()
        await trio.sleep(1)  # virtual time: the client is gone by then
        await reply({"progress": {"n": 2}})
        return {"done": True}

    server = server_with(tmp_path, stream=stream)
    client, end = trio.testing.memory_stream_pair()
    with caplog.at_level(logging.DEBUG, logger="p2pnet.control"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server._handle, end)
            await client.send_all(b'{"cmd": "stream"}\n')
            await sent.wait()
            await client.aclose()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert "went away" in caplog.records[0].getMessage()

"""The local control socket: how `p2pnet ... status` talks to a running peer.

A Unix socket `control.sock` in the data directory (mode 0600, so only the peer's user can
use it). One request per connection: a JSON object line `{"cmd": NAME, ...}`, answered by one
JSON line: the command's result, or `{"error": "...", "reason": CODE}`. Commands are
registered by the node and its roles; a command that takes time (a fetch) streams progress
lines `{"progress": ...}` before its final line.

Theory of operation. Nothing a client sends may stop the peer. `parse_request` (pure, no
I/O) turns one request line into a dict or raises `RequestRefused` with a stable `Reason`:
oversized, not UTF-8, nested deeper than `MAX_REQUEST_DEPTH` (measured before parsing, so
the parser cannot recurse away), not JSON, NaN/Infinity or an out-of-range number, not an
object, `cmd` missing or not a string, unknown command. The server then runs the command and
turns what it raises into an answer: the user's errors (`ConfigError`, `ValueError`,
`TypeError`, `KeyError`, an `OSError` from a path they named) and our named errors
(`LocalStateError`, `PeerUnavailable`, ...) become `{"error", "reason", "field"}` answers;
anything else is a bug, logged with its traceback at ERROR and answered `internal`, and the
peer keeps running. At most `max_in_flight` requests run at once; a client that cannot get a
slot within `queue_wait_s` is answered `busy`. A client that goes away mid-answer, or stops
reading for `SEND_TIMEOUT_S`, is not an error (logged at DEBUG); its command is abandoned.

This module must not know what any command does.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Awaitable, Callable, Collection

import trio

from p2pnet.errors import ConfigError, LocalStateError, P2PNetError, PeerUnavailable
from p2pnet.jsonlimits import exceeds_depth

log = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
MAX_REQUEST_BYTES = 64 * 1024
MAX_REQUEST_DEPTH = 16
MAX_IN_FLIGHT = 64
SEND_TIMEOUT_S = 30.0  # a client that stops reading an answer this long is treated as gone
LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn; a full backlog fails connects
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
Reply = Callable[[dict[str, Any]], Awaitable[None]]
Command = Callable[[dict[str, Any], Reply], Awaitable[dict[str, Any]]]


class Reason(enum.StrEnum):
    """Stable codes in the `reason` of an error answer."""

    TOO_LARGE = "too_large"
    EMPTY = "empty"
    NOT_UTF8 = "not_utf8"
    TOO_DEEP = "too_deep"
    NOT_JSON = "not_json"
    NON_FINITE_NUMBER = "non_finite_number"
    NUMBER_OUT_OF_RANGE = "number_out_of_range"
    NOT_OBJECT = "not_object"
    BAD_CMD = "bad_cmd"
    UNKNOWN_COMMAND = "unknown_command"
    TIMEOUT = "timeout"
    BAD_FIELD = "bad_field"
    MISSING_FIELD = "missing_field"
    PATH_ERROR = "path_error"
    LOCAL_STATE = "local_state"
    PEER_UNAVAILABLE = "peer_unavailable"
    REFUSED = "refused"
    BUSY = "busy"
    INTERNAL = "internal"


class RequestRefused(ConfigError):
    """A control request we will not run (the local client's fault); `reason` is a `Reason`."""

    def __init__(self, reason: Reason, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.reason = reason


# a Python class name opening an error text ("PeerUnavailable: version 9 ..."): not for users' eyes
_CLASS_PREFIX = re.compile(r"^(?:[A-Z][a-z0-9]+){2,}: ")


class CommandRefused(P2PNetError):
    """The running peer answered a control request with `{"error": ...}`; the message is the
    peer's sentence without any Python class name in front of it."""

    def __init__(self, cmd: str, answer: dict[str, Any]) -> None:
        super().__init__(f"the running peer refused {cmd}: {_CLASS_PREFIX.sub('', str(answer.get('error')))}")
        self.reason = str(answer.get("reason", ""))
        self.answer = answer


# -- the pure request parser ----------------------------------------------------------------


def parse_request(line: bytes, commands: Collection[str]) -> dict[str, Any]:
    """One request line -> its JSON object, with a known string `cmd`; else RequestRefused."""
    if len(line) > MAX_REQUEST_BYTES:
        raise RequestRefused(Reason.TOO_LARGE, "request", f"over {MAX_REQUEST_BYTES} bytes")
    try:
        text = bytes(line).decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise RequestRefused(Reason.NOT_UTF8, "request", f"not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    if not text:
        raise RequestRefused(Reason.EMPTY, "request", "empty request")
    if exceeds_depth(text, MAX_REQUEST_DEPTH):
        raise RequestRefused(Reason.TOO_DEEP, "request", f"nested deeper than {MAX_REQUEST_DEPTH}")
    try:
        payload = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                             parse_int=_bounded_int)
    except RequestRefused:
        raise
    except RecursionError as exc:  # cannot happen after exceeds_depth; named all the same
        raise RequestRefused(Reason.TOO_DEEP, "request", "nested too deep") from exc
    except ValueError as exc:
        raise RequestRefused(Reason.NOT_JSON, "request", f"not JSON ({exc})") from exc
    if not isinstance(payload, dict):
        raise RequestRefused(Reason.NOT_OBJECT, "request", f"a JSON object, not {_json_type(payload)}")
    cmd = payload.get("cmd")
    if not isinstance(cmd, str):
        problem = "missing" if cmd is None else f"a string, not {_json_type(cmd)}"
        raise RequestRefused(Reason.BAD_CMD, "cmd", problem)
    if cmd not in commands:
        raise RequestRefused(Reason.UNKNOWN_COMMAND, "cmd", f"unknown command {cmd[:64]!r}; known: "
                             f"{', '.join(sorted(commands))}")
    return payload


def _refuse_constant(name: str) -> Any:
    raise RequestRefused(Reason.NON_FINITE_NUMBER, "request", f"{name} is not a JSON number")


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise RequestRefused(Reason.NON_FINITE_NUMBER, "request", f"{literal[:32]} overflows a float")
    return value


def _bounded_int(literal: str) -> int:
    if len(literal) > 21 or not _INT_MIN <= int(literal) <= _INT_MAX:
        raise RequestRefused(Reason.NUMBER_OUT_OF_RANGE, "request", f"integer {literal[:32]} outside 64 bits")
    return int(literal)


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# -- errors raised by commands, as answers ----------------------------------------------------


def error_answer(exc: BaseException, request: dict[str, Any] | None = None) -> dict[str, Any]:
    """The answer for an exception a command raised; logs (with traceback) the ones that are bugs."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = _leaves(exc)
        if len(leaves) == 1:
            return error_answer(leaves[0], request)
    reason, field, problem = _classify(exc, request or {})
    if reason is Reason.INTERNAL:
        log.error("control command %r failed", (request or {}).get("cmd"), exc_info=exc)
    answer: dict[str, Any] = {"error": f"{field}: {problem}" if field else problem, "reason": str(reason)}
    if field:
        answer["field"] = field
    return answer


def _classify(exc: BaseException, request: dict[str, Any]) -> tuple[Reason, str, str]:
    if isinstance(exc, RequestRefused):
        return exc.reason, exc.field, exc.problem
    if isinstance(exc, ConfigError):
        return Reason.BAD_FIELD, exc.field, exc.problem
    if isinstance(exc, LocalStateError):
        return Reason.LOCAL_STATE, "", str(exc)
    if isinstance(exc, PeerUnavailable):
        return Reason.PEER_UNAVAILABLE, "", str(exc)
    if isinstance(exc, P2PNetError):
        return Reason.REFUSED, "", f"{type(exc).__name__}: {exc}"
    if isinstance(exc, KeyError):
        key = exc.args[0] if exc.args else ""
        if isinstance(key, str) and key not in request:
            return Reason.MISSING_FIELD, key, "missing"
        return Reason.BAD_FIELD, "request", f"no such entry {str(key)[:64]!r}"
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        return Reason.BAD_FIELD, "request", f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else ""
        detail = f"{where}: {exc.strerror or exc}" if where else str(exc)
        return Reason.PATH_ERROR, _field_naming(request, where), detail
    return Reason.INTERNAL, "", f"internal error: {type(exc).__name__}: {exc}"


def _field_naming(request: dict[str, Any], path: object) -> str:
    """The request field whose path value is, contains or lies under `path` (else "request")."""
    path = str(path)
    if not path:
        return "request"
    for key, value in request.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and item and (
                    path == item or path.startswith(item.rstrip("/") + "/") or item.startswith(path.rstrip("/") + "/")):
                return str(key)
    return "request"


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


# -- the server -------------------------------------------------------------------------------


class _ClientGone(Exception):
    """The control client closed its connection; nothing is left to answer."""


class ControlServer:
    def __init__(self, data_dir: Path, *, max_in_flight: int = MAX_IN_FLIGHT, queue_wait_s: float = 10.0,
                 read_timeout_s: float = 5.0) -> None:
        self.path = data_dir / SOCKET_NAME
        self._commands: dict[str, Command] = {}
        self._limiter = trio.CapacityLimiter(max_in_flight)
        self.queue_wait_s = queue_wait_s
        self.read_timeout_s = read_timeout_s

    def register(self, name: str, command: Command) -> None:
        if name in self._commands:
            raise ValueError(f"control command {name!r} registered twice")
        self._commands[name] = command

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if len(str(self.path)) > 100:
            raise LocalStateError(f"data directory path too long for a control socket: {self.path}")
        if self.path.exists():
            self.path.unlink()  # the data-dir lock is held, so this is a stale socket of ours
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        sock.listen(LISTEN_BACKLOG)
        listener = trio.SocketListener(sock)
        task_status.started()
        try:
            await trio.serve_listeners(self._handle, [listener])
        finally:
            self.path.unlink(missing_ok=True)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                acquired = False
                with trio.move_on_after(self.queue_wait_s):
                    await self._limiter.acquire()
                    acquired = True
                if not acquired:
                    await _send(stream, {"error": f"busy: {self._limiter.total_tokens} requests in flight",
                                         "reason": str(Reason.BUSY)})
                    return
                try:
                    await _send(stream, await self._answer(stream))
                finally:
                    self._limiter.release()
            except _ClientGone:
                log.debug("control client went away before its answer")

    async def _answer(self, stream: trio.SocketStream) -> dict[str, Any]:
        """The final answer to one connection's request (progress lines go out on the way)."""
        try:
            with trio.fail_after(self.read_timeout_s):
                line = await _read_line(stream, MAX_REQUEST_BYTES)
            request = parse_request(line, self._commands)
        except RequestRefused as exc:
            log.debug("control request refused: %s", exc)
            return error_answer(exc)
        except trio.TooSlowError:
            return {"error": f"request: no complete line within {self.read_timeout_s}s", "reason": str(Reason.TIMEOUT)}

        async def reply(obj: dict[str, Any]) -> None:
            await _send(stream, obj)

        try:
            answer = await self._commands[request["cmd"]](request, reply)
        except _ClientGone:
            raise
        except Exception as exc:  # every failure of a command becomes an answer; bugs are logged
            if isinstance(exc, BaseExceptionGroup) and any(isinstance(e, _ClientGone) for e in _leaves(exc)):
                raise _ClientGone() from exc
            return error_answer(exc, request)
        if not isinstance(answer, dict):
            log.error("control command %r answered %s, not a dict", request["cmd"], type(answer).__name__)
            return {"error": f"internal error: {request['cmd']} answered no object", "reason": str(Reason.INTERNAL)}
        return answer


async def _send(stream: trio.abc.SendStream, obj: dict[str, Any]) -> None:
    """One answer line; a client that has gone raises _ClientGone, a bad answer is logged."""
    try:
        line = json.dumps(obj).encode() + b"\n"
    except (TypeError, ValueError) as exc:
        log.error("control answer is not JSON: %s", exc, exc_info=exc)
        line = json.dumps({"error": f"internal error: answer is not JSON ({exc})",
                           "reason": str(Reason.INTERNAL)}).encode() + b"\n"
    try:
        with trio.move_on_after(SEND_TIMEOUT_S) as scope:
            await stream.send_all(line)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise _ClientGone() from exc
    if scope.cancelled_caught:
        raise _ClientGone(f"the client read nothing for {SEND_TIMEOUT_S}s")


async def _read_line(stream: trio.abc.ReceiveStream, limit: int) -> bytes:
    """The request line (without its newline); a client that sends nothing gets EMPTY."""
    data = bytearray()
    while b"\n" not in data:
        try:
            chunk = await stream.receive_some(4096)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _ClientGone() from exc
        if not chunk:
            return bytes(data)  # EOF: the request is what came (parse_request refuses an empty one)
        data += chunk
        if data.find(b"\n", 0, limit + 1) < 0 and len(data) > limit:
            raise RequestRefused(Reason.TOO_LARGE, "request", f"over {limit} bytes")
    return bytes(data.split(b"\n", 1)[0])


# -- the client -------------------------------------------------------------------------------


async def call(data_dir: Path, request: dict[str, Any], *, on_progress: Callable[[dict], None] | None = None,
               timeout_s: float = 30.0, check: bool = False) -> dict[str, Any]:
    """Send one control request to the peer running in `data_dir`; return its final reply.

    With `check`, an error answer raises CommandRefused instead of being returned.
    """
    path = data_dir / SOCKET_NAME
    if not path.exists():
        raise PeerUnavailable(f"no peer is running with data directory {data_dir} (no {path}); start one with "
                              f"`p2pnet peer start --data-dir {data_dir}`, or give the --data-dir of a running peer")
    try:
        with trio.fail_after(timeout_s):
            stream = await trio.open_unix_socket(str(path))
            async with stream:
                await stream.send_all(json.dumps(request).encode() + b"\n")
                answer = await _final_line(stream, on_progress)
    except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
        raise PeerUnavailable(f"control socket {path}: {str(exc) or type(exc).__name__}") from exc
    if check and "error" in answer:
        raise CommandRefused(str(request.get("cmd")), answer)
    return answer


async def _final_line(stream: trio.SocketStream, on_progress: Callable[[dict], None] | None) -> dict[str, Any]:
    buffer = bytearray()
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise PeerUnavailable("the peer closed the control connection without a reply")
        buffer += chunk
        while b"\n" in buffer:
            line, _, rest = bytes(buffer).partition(b"\n")
            buffer = bytearray(rest)
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise PeerUnavailable(f"unreadable control answer ({exc})") from exc
            if not isinstance(obj, dict):
                raise PeerUnavailable("control answer is not a JSON object")
            if "progress" not in obj:
                return obj
            if on_progress is not None:
                on_progress(obj["progress"])

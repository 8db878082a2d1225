"""The local control socket: how `p2pnet ... status` talks to a running peer.

A Unix socket `control.sock` in the data directory (mode 0600, so only the peer's user can
use it). One request per connection: a JSON object line `{"cmd": NAME, ...}`, answered by one
JSON line: the command's result, or `{"error": "..."}`. Commands are registered by the node and
its roles; a command that takes time (a fetch) streams progress lines `{"progress": ...}` before
its final line.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from p2pnet.errors import LocalStateError, PeerUnavailable

log = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
MAX_REQUEST_BYTES = 64 * 1024
Reply = Callable[[dict[str, Any]], Awaitable[None]]
Command = Callable[[dict[str, Any], Reply], Awaitable[dict[str, Any]]]


class ControlServer:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / SOCKET_NAME
        self._commands: dict[str, Command] = {}

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
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        try:
            await trio.serve_listeners(self._handle, [listener])
        finally:
            self.path.unlink(missing_ok=True)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            async def reply(obj: dict[str, Any]) -> None:
                await stream.send_all(json.dumps(obj).encode() + b"\n")

            try:
                with trio.fail_after(5):
                    request = await _read_line(stream, MAX_REQUEST_BYTES)
                payload = json.loads(request)
                if not isinstance(payload, dict):
                    raise ValueError("request is not a JSON object")
                command = self._commands.get(payload.get("cmd", ""))
                if command is None:
                    await reply({"error": f"unknown command {payload.get('cmd')!r}; known: {sorted(self._commands)}"})
                    return
                await reply(await command(payload, reply))
            except (ValueError, trio.TooSlowError, EOFError) as exc:
                await _try_reply(reply, {"error": f"bad request: {exc}"})
            except trio.BrokenResourceError:
                log.debug("control client went away")


async def _try_reply(reply: Reply, obj: dict[str, Any]) -> None:
    try:
        await reply(obj)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        log.debug("control client went away before the error reply")


async def _read_line(stream: trio.abc.ReceiveStream, limit: int) -> bytes:
    data = bytearray()
    while b"\n" not in data:
        chunk = await stream.receive_some(4096)
        if not chunk:
            if data:
                return bytes(data)
            raise EOFError("empty request")
        data += chunk
        if len(data) > limit:
            raise ValueError("request too long")
    return bytes(data.split(b"\n", 1)[0])


async def call(data_dir: Path, request: dict[str, Any], *, on_progress: Callable[[dict], None] | None = None,
               timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one control request to the peer running in `data_dir`; return its final reply."""
    path = data_dir / SOCKET_NAME
    if not path.exists():
        raise PeerUnavailable(f"no peer is running with data directory {data_dir} (no {path})")
    try:
        with trio.fail_after(timeout_s):
            stream = await trio.open_unix_socket(str(path))
            async with stream:
                await stream.send_all(json.dumps(request).encode() + b"\n")
                buffer = bytearray()
                while True:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        raise PeerUnavailable("the peer closed the control connection without a reply")
                    buffer += chunk
                    while b"\n" in buffer:
                        line, _, rest = bytes(buffer).partition(b"\n")
                        buffer = bytearray(rest)
                        obj = json.loads(line)
                        if "progress" in obj and on_progress is not None:
                            on_progress(obj["progress"])
                        elif "progress" not in obj:
                            return obj
    except (OSError, trio.TooSlowError) as exc:
        raise PeerUnavailable(f"control socket {path}: {exc}") from exc

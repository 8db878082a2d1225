"""A real relay peer process against hostile control requests, a crowd of clients and CLI typos.

One peer serves every test here (starting it is the slow part). Requests go raw to its
`control.sock`, one JSON line each, the way an attacker or a buggy script would send them.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trio
from safetensors.numpy import save_file

from p2pnet.control import SOCKET_NAME
from p2pnet.localnet import PeerProcess, start_peer

pytestmark = pytest.mark.slow
CLIENTS = 200


@pytest.fixture(scope="module")
def peer(tmp_path_factory) -> PeerProcess:
    root = tmp_path_factory.mktemp("ctl")
    proc = start_peer("p", root / "p", roles=["relay"], extra_args=["--heartbeat-interval-s", "0.5"])
    try:
        proc.wait_ready(60)
        save_file({"w": np.arange(64, dtype=np.float32)}, str(root / "good.safetensors"))
        answer = raw(proc, json.dumps({"cmd": "checkpoint.publish", "paths": [str(root / "good.safetensors")],
                                       "model": "m", "version": 1}).encode())
        assert answer["version"] == 1, answer
        yield proc
    finally:
        proc.stop(timeout_s=15)
    assert "Traceback" not in proc.log_path.read_text()  # nothing was a bug, nothing crashed


def raw(peer: PeerProcess, line: bytes, timeout_s: float = 30.0) -> dict:
    """Send one raw request line; the final answer line, parsed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(peer.data_dir / SOCKET_NAME))
        sock.sendall(line + b"\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return json.loads(data.splitlines()[-1])


def cli(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pnet", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=60)


def deep_safetensors(path: Path) -> Path:
    header = b'{"w": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def test_the_peer_survives_each_bad_request_and_still_answers(peer, tmp_path):
    regular = tmp_path / "a-file"
    regular.write_text("not a directory")
    fetch = {"cmd": "checkpoint.fetch", "version": 1, "timeout_s": 5}
    requests = {
        "out_dir under a regular file": (json.dumps(fetch | {"out_dir": f"{regular}/sub"}), "path_error"),
        "out_dir is a regular file": (json.dumps(fetch | {"out_dir": str(regular)}), "path_error"),
        "cmd is an array": ('{"cmd": []}', "bad_cmd"),
        "cmd is an object": ('{"cmd": {"a": 1}}', "bad_cmd"),
        "deeply nested": ('{"cmd": "status", "x": ' + "[" * 30_000 + "]" * 30_000 + "}", "too_deep"),
        "Infinity": ('{"cmd": "checkpoint.fetch", "version": Infinity, "out_dir": "/tmp/x"}', "non_finite_number"),
        "NaN timeout": ('{"cmd": "checkpoint.fetch", "version": 1, "out_dir": "/tmp/x", "timeout_s": NaN}',
                        "non_finite_number"),
        "huge version": ('{"cmd": "checkpoint.fetch", "version": 1' + "0" * 40 + "}", "number_out_of_range"),
        "not UTF-8": (b'{"cmd": "\xff"}', "not_utf8"),
        "deeply nested safetensors header": (json.dumps({
            "cmd": "checkpoint.publish", "paths": [str(deep_safetensors(tmp_path / "deep.safetensors"))],
            "model": "m", "version": 2}), None),
    }
    for what, (line, reason) in requests.items():
        answer = raw(peer, line if isinstance(line, bytes) else line.encode())
        assert "error" in answer, (what, answer)
        assert reason is None or answer["reason"] == reason, (what, answer)
        assert peer.alive(), what
        assert raw(peer, b'{"cmd": "status"}')["peer_id"] == peer.peer_id, what
    assert "not a safetensors file" in answer["error"] and "nests deeper" in answer["error"]


def test_two_hundred_concurrent_clients_all_get_an_answer(peer):
    answers: list[dict] = []

    async def one_client() -> None:
        stream = await trio.open_unix_socket(str(peer.data_dir / SOCKET_NAME))
        async with stream:
            await stream.send_all(b'{"cmd": "status"}\n')
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
        answers.append(json.loads(data))

    async def crowd() -> None:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for _ in range(CLIENTS):
                    nursery.start_soon(one_client)

    trio.run(crowd)
    assert len(answers) == CLIENTS
    assert all(a.get("peer_id") == peer.peer_id or a.get("reason") == "busy" for a in answers)
    assert raw(peer, b'{"cmd": "status"}')["peer_id"] == peer.peer_id


def test_fetch_into_a_path_under_a_regular_file_is_one_line_and_exit_2(peer, tmp_path):
    regular = tmp_path / "a-file"
    regular.write_text("x")
    for out in (regular / "sub", regular):
        done = cli("checkpoint", "fetch", "1", "--data-dir", str(peer.data_dir), "--out", str(out))
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("p2pnet: error: --out: "), done.stderr
    assert not (regular.parent / "sub").exists()


def test_an_error_answer_is_one_line_and_exit_2(peer, tmp_path):
    done = cli("checkpoint", "fetch", "99", "--data-dir", str(peer.data_dir), "--out", str(tmp_path / "o"),
               "--timeout-s", "0.2")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "refused checkpoint.fetch" in done.stderr, done.stderr


def test_a_closed_stdout_ends_status_quietly(peer):
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head -1` that has already exited
    try:
        done = cli("peer", "status", "--data-dir", str(peer.data_dir), stdout=write_end)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and done.stderr == ""

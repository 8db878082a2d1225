"""What a user sees when `p2pnet` is given something it cannot use: one `p2pnet: error:` line on
stderr, exit status 2, no traceback; and the logging flags and format, in real processes."""

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
    assert not [line for line in lines if " DEBUG multiaddr" in line or " DEBUG libp2p.stream_muxer" in line]
    assert "Traceback" not in "\n".join(lines)

"""`reserve_port` (tests/port_fixtures.py): ports the kernel never hands out, held against other
processes of the suite, and a closed one refusing connections."""

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

from tests.port_fixtures import reservable_ports, reserve

ROOT = Path(__file__).resolve().parents[1]


def test_reserved_ports_are_outside_the_kernels_ephemeral_range(reserve_port, tmp_path):
    low, high = (int(w) for w in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [reserve_port(), reserve_port(closed=True)]
    assert len(set(ports)) == 2 and not any(low <= port <= high for port in ports), (ports, low, high)
    custom = tmp_path / "range"
    custom.write_text("1024\t60999\n")  # nothing below: the band above
    assert reservable_ports(custom) == list(range(61000, 61000 + 4096))
    custom.write_text("5000\t60999\n")  # the band below holds ports the project names
    assert reservable_ports(custom) == [port for port in range(1024, 5000) if port not in (4001, 4002, 4011)]


def test_a_reserved_port_is_not_given_to_another_process_of_the_suite(reserve_port):
    port = reserve_port()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # free for whoever will listen there
    other = subprocess.run([sys.executable, "-c", (
        "import contextlib\nfrom tests.port_fixtures import reserve\n"
        "with contextlib.ExitStack() as stack:\n"
        f"    print(reserve(stack, candidates=[{port}]))\n")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert other.returncode != 0 and "no free port to reserve" in other.stderr, other.stdout + other.stderr


def test_a_closed_port_refuses_connections_and_cannot_be_bound(reserve_port):
    closed = reserve_port(closed=True)
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", closed), timeout=10):
        pass
    with socket.socket() as other, pytest.raises(OSError):
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", closed))


def test_a_port_in_use_is_not_reserved():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with contextlib.ExitStack() as stack, pytest.raises(RuntimeError, match="no free port"):
            reserve(stack, candidates=[taken.getsockname()[1]])


def test_a_killed_run_leaves_no_lock_behind():
    """A run killed while it holds a port (SIGKILL: no teardown) leaves its lock file, not its lock."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import contextlib, time\nfrom tests.port_fixtures import reserve\n"
        "with contextlib.ExitStack() as stack:\n    print(reserve(stack), flush=True)\n    time.sleep(600)\n")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        with contextlib.ExitStack() as stack, pytest.raises(RuntimeError, match="no free port"):
            reserve(stack, candidates=[port])  # held while the holder lives
    finally:
        holder.kill()
        holder.wait(60)
        holder.stdout.close()
    with contextlib.ExitStack() as stack:
        assert reserve(stack, candidates=[port]) == port


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_lock_directories_of_another_user_do_not_stop_a_reservation():
    """Another user (here root) has run the suite, leaving lock directories behind (the old shared
    name as well); a second user (nobody, in a forked child) still reserves a port."""
    shared = Path(tempfile.mkdtemp(prefix="p2pnet-tmp-"))
    try:
        shared.chmod(0o1777)  # a temporary directory like /tmp
        for name in ("p2pnet-test-ports", f"p2pnet-test-ports-{os.getuid()}"):
            (shared / name).mkdir(mode=0o755)
        nobody = pwd.getpwnam("nobody")
        child = os.fork()
        if child == 0:  # pragma: no cover (the child reports by its exit status)
            code = 1
            try:
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                tempfile.tempdir = str(shared)
                with contextlib.ExitStack() as stack:
                    reserve(stack)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "nobody could not reserve a port (traceback above)"
    finally:
        shutil.rmtree(shared)

"""The `reserve_port` fixture: a TCP port on loopback that a test may name before anyone listens there.

    def test_x(reserve_port):
        port = reserve_port()              # free now; a peer started later listens on it
        closed = reserve_port(closed=True)  # nothing can listen on it until the test ends

Asking the kernel for a free port (bind to port 0, read it, close) and using it later is a race:
the kernel hands out the ports of its ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`)
to any bind to port 0 and to the source of any outgoing connection, of this test's processes, of
another pytest-xdist worker or of anything else on the machine, and may hand out that one in
between. So a reserved port is taken outside that range (the kernel hands those out to nobody:
only a program naming the port binds it), is checked free by binding it, and is held against the
other tests of the suite, in this process or another, by an exclusive lock on a file named after
it (`flock`, released at the end of the test or when its process dies, however it dies: a killed
run leaves files but no locks). The files are in a directory of the user's own (`locks_dir`): one
shared by every user would belong to whoever made it first, and nobody else could lock in it
(suites of two users coordinate only by the bind check). The band is the 4,096 ports just below
the ephemeral range (28672-32767 with Linux's default 32768-60999), else the ports above it; the
fixed ports the project names (`FIXED_PORTS`: the README's, the dashboard's default, 4001 in lab
namespaces) are left out, since with another range they may fall in the band. A `closed` port
also keeps its socket bound and not listening until the test ends: Linux refuses connections to
it, and no other socket can bind it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

BAND_PORTS = 4096
# Named in README.md (4001, 4002, 4011, 9100: tests/test_readme.py replaces or skips them), in lab
# tests (4001) and as `p2pnet dashboard`'s default (8080): a user's own peer may be listening there.
FIXED_PORTS = frozenset({4001, 4002, 4011, 8080, 9100})


def reservable_ports(range_path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> list[int]:
    """The ports the kernel never hands out on its own: the band below the ephemeral range, or above it."""
    low, high = (int(word) for word in range_path.read_text().split())
    band = range(max(1024, low - BAND_PORTS), low) or range(high + 1, min(65536, high + 1 + BAND_PORTS))
    ports = [port for port in band if port not in FIXED_PORTS]
    if not ports:
        raise RuntimeError(f"no ports outside the ephemeral range {low}-{high} to reserve for tests")
    return ports


def locks_dir() -> Path:
    """This user's directory of port locks, made if missing: `p2pnet-test-ports-<uid>` in the
    temporary directory, refused (RuntimeError) if it is anything but a directory of this user's."""
    path = Path(tempfile.gettempdir()) / f"p2pnet-test-ports-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a directory of this user's: remove it to reserve test ports")
    return path


def reserve(stack: contextlib.ExitStack, *, closed: bool = False, candidates: Sequence[int] | None = None) -> int:
    """A port of `candidates` (`reservable_ports`) that no other reservation holds and nothing is
    bound to, held until `stack` closes (with its socket, bound and not listening, if `closed`)."""
    ports = list(candidates if candidates is not None else reservable_ports())
    random.SystemRandom().shuffle(ports)  # two workers rarely try the same ports in turn
    locks = locks_dir()
    for port in ports:
        lock = open(locks / str(port), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))  # no SO_REUSEADDR: in use, or still in TIME_WAIT, is not free
        except OSError:
            sock.close()
            lock.close()
            continue
        stack.callback(lock.close)  # closing the file releases the lock
        if closed:
            stack.callback(sock.close)
        else:
            sock.close()  # never listened or connected: free at once for the peer that will listen
        return port
    raise RuntimeError(f"no free port to reserve among {len(ports)} (locks in {locks})")


@pytest.fixture
def reserve_port() -> Iterator[Callable[..., int]]:
    with contextlib.ExitStack() as stack:
        yield lambda closed=False: reserve(stack, closed=closed)

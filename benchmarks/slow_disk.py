"""Run a command with its files on a slow disk: a loop device capped in bytes and writes per second.

    sudo .venv/bin/python benchmarks/slow_disk.py --write-mbps 150 --write-iops 200 -- \\
        .venv/bin/python benchmarks/bench_relay_loopback.py --mib 512 --tmp {}

The loopback race runs on whatever disk the machine has; a peer's disk may be a spinning one or
a cloud volume of 125-250 MB/s and a few thousand writes a second, where how often the relay
fsyncs could matter more than its CPU. This makes such a disk: an ext4 file system on a loop
device over a sparse file (`--image-dir`), mounted in a fresh folder, with the kernel's block
throttle (cgroup v1 `blkio.throttle.write_bps_device` / `write_iops_device` of the root group:
every writer to that device, the kernel's flusher threads too) capping its writes. Every `{}` in
the command becomes the mount point. Reads are not capped (the page cache serves them anyway).

Needs root, `losetup`, `mkfs.ext4` and cgroup v1's blkio controller (mounted at
/sys/fs/cgroup/blkio); where one is missing it says which and changes nothing. Whatever happens
to the command (it fails, Ctrl-C, SIGTERM), the throttle is lifted, the file system unmounted,
the loop device detached and its file removed before this exits; exits with the command's status.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

BLKIO = Path("/sys/fs/cgroup/blkio")


class Unavailable(SystemExit):
    """This machine cannot make a slow disk (what is missing is in the message)."""


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable(f"slow_disk: {' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()


def _throttle(device: str, mbps: float, iops: int) -> None:
    """Cap writes to `device` (MAJ:MIN); 0 lifts a cap."""
    (BLKIO / "blkio.throttle.write_bps_device").write_text(f"{device} {int(mbps * 1e6)}\n")
    (BLKIO / "blkio.throttle.write_iops_device").write_text(f"{device} {iops}\n")


def check_machine() -> None:
    if os.geteuid() != 0:
        raise Unavailable("slow_disk: needs root (loop devices, mounts and the block throttle)")
    for tool in ("losetup", "lsblk", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise Unavailable(f"slow_disk: {tool} is not installed")
    if not (BLKIO / "blkio.throttle.write_bps_device").exists():
        raise Unavailable(f"slow_disk: no cgroup v1 block throttle at {BLKIO} (a cgroup v2-only machine "
                          "is not supported)")


@contextlib.contextmanager
def slow_disk(write_mbps: float, write_iops: int, size_gib: int, image_dir: Path) -> Iterator[Path]:
    """A fresh ext4 file system whose writes are capped; yields its mount point. Every step
    taken is undone on the way out, last first, even when a later step failed."""
    check_machine()
    with contextlib.ExitStack() as undo:
        fd, name = tempfile.mkstemp(prefix="slow-disk-", suffix=".img", dir=image_dir)
        os.close(fd)
        image = Path(name)
        undo.callback(image.unlink, missing_ok=True)
        os.truncate(image, size_gib << 30)
        loop = _run("losetup", "--find", "--show", str(image))
        undo.callback(_run, "losetup", "--detach", loop)
        _run("mkfs.ext4", "-q", "-F", loop)
        mount = Path(tempfile.mkdtemp(prefix="slow-disk-"))
        undo.callback(mount.rmdir)
        _run("mount", loop, str(mount))
        undo.callback(_run, "umount", str(mount))
        device = _run("lsblk", "--nodeps", "--noheadings", "--output", "MAJ:MIN", loop).replace(" ", "")
        undo.callback(_throttle, device, 0, 0)
        _throttle(device, write_mbps, write_iops)
        print(f"slow disk at {mount} ({loop}, device {device}): writes capped at {write_mbps:g} MB/s"
              + (f" and {write_iops} requests/s" if write_iops else ""), file=sys.stderr, flush=True)
        yield mount


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--write-mbps", type=float, required=True, help="write cap in MB/s (10^6 bytes)")
    parser.add_argument("--write-iops", type=int, default=0, help="write requests per second (default 0: no cap)")
    parser.add_argument("--size-gib", type=int, default=24, help="the file system's size (sparse; default 24)")
    parser.add_argument("--image-dir", type=Path, default=Path("/var/tmp"),
                        help="where the loop device's file goes (default /var/tmp)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command; {} is the mount point")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    if not args.write_mbps > 0 or args.write_iops < 0 or args.size_gib < 1:
        parser.error("--write-mbps must be > 0, --write-iops >= 0 and --size-gib >= 1")
    # `timeout` and kill send SIGTERM: leave through the undo steps, as on Ctrl-C
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with slow_disk(args.write_mbps, args.write_iops, args.size_gib, args.image_dir) as mount:
        return subprocess.run([part.replace("{}", str(mount)) for part in command]).returncode


if __name__ == "__main__":
    sys.exit(main())

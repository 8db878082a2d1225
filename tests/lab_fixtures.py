"""The `lab_factory` fixture: build real network labs (p2pnet.lab) that are always taken down.

    def test_x(lab_factory):
        lab = lab_factory([HostSpec("a", upload_mbit=40), HostSpec("b", nat="home")])
        lab.popen("a", [sys.executable, "-c", "..."])

The test is skipped, with the lab's one-line reason, where the lab cannot run (not root, no
`ip`, no `nft` for NAT'd hosts). Each lab gets a unique id and a state directory under tmp_path;
`down()` runs at teardown whatever the test did, and stops the processes it started in the lab.
"""

from __future__ import annotations

import itertools
import secrets
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pytest

from p2pnet.lab import HostSpec, Lab, LabSpec, cleanup_stale, lab_unavailable, nat_unavailable


@pytest.fixture
def lab_factory(tmp_path: Path) -> Iterator[Callable[..., Lab]]:
    labs: list[Lab] = []
    counter = itertools.count()

    def make_lab(spec_hosts: Iterable[HostSpec], *, lab_id: str | None = None) -> Lab:
        hosts = tuple(spec_hosts)
        reason = nat_unavailable() if any(h.nat for h in hosts) else lab_unavailable()
        if reason is not None:
            pytest.skip(reason)
        cleanup_stale()  # labs of test runs that were killed before their teardown
        spec = LabSpec(hosts, lab_id or f"t{secrets.token_hex(4)}")
        lab = Lab.up(spec, tmp_path / f"lab{next(counter)}-{spec.lab_id}")
        labs.append(lab)
        return lab

    yield make_lab
    errors = []
    for lab in labs:
        try:
            lab.down()
        except Exception as exc:  # take every lab down before reporting the first failure
            errors.append(exc)
    if errors:
        raise errors[0]

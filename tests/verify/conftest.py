"""Shared fixtures of the verify tests.

`topk_path`: the TOPLOC selection and proof tests (modules that use it, by `pytestmark`) run
once with verify's C module (`verify/_ctopk.c`, where `make install` built it) and once with it
set aside (numpy and torch, what an install without a compiler and `P2PNET_VERIFY_PURE=1` run),
so a run of the suite checks both paths, which must give the same bytes.
"""

from __future__ import annotations

import pytest

import verify.topk


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "topk_path" in metafunc.fixturenames:
        paths = ["c", "numpy"] if verify.topk.ACCELERATOR is not None else ["numpy"]
        metafunc.parametrize("topk_path", paths, indirect=True)


@pytest.fixture
def topk_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numpy":
        monkeypatch.setattr(verify.topk, "ACCELERATOR", None)
    return request.param

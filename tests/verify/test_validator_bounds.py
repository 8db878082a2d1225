"""What a validator spends on one worker's submission is bounded before the check: the output it
recomputes (a 250,000-token output fit in one 2 MiB frame, and its forward pass stopped the peer),
and the wait for the model version it claims (a far-future version held the one check loop
`version_wait_s` per submission, so honest work was dropped as the queue was full)."""

from __future__ import annotations

import dataclasses
import types

import trio
import trio.testing

from tests.verify.test_validator_core import V1, WORKER, core_for, envelope, events, submission
from verify.daemon import RelayModelSource, ValidatorRole
from verify.validator import CheckRequested, SubmissionRejected


def test_submissions_allowing_longer_outputs_than_the_validator_recomputes_are_refused_unchecked():
    core = core_for(V1, max_new_tokens=8)
    long_allowed = dataclasses.replace(submission(step=1), max_new_tokens=250_000)
    effects = core.on_message(1.0, envelope(WORKER, long_allowed))
    assert [e.reason for e in events(effects, SubmissionRejected)] == ["too_long"]
    assert events(effects, CheckRequested) == []
    honest = submission(step=2)  # max_new_tokens 8, as the validator's (its outputs within it: `Submission`)
    assert events(core.on_message(3.0, envelope(WORKER, honest)), SubmissionRejected) == []


class _Watcher:
    latest = 3

    def is_complete(self, version: int) -> bool:
        return False  # never comes

    async def wait_newer(self, version: int, at_least: int) -> None:
        await trio.sleep_forever()


def test_a_far_future_version_is_not_waited_for_the_next_one_is():
    async def main() -> dict[int, float]:
        spent: dict[int, float] = {}
        failed: list[int] = []

        class Runner:
            async def command(self, fn) -> None:
                failed.append(1)

        models = RelayModelSource.__new__(RelayModelSource)  # (only its type is asked)

        def unavailable(request):
            from verify.daemon import ModelUnavailable
            raise ModelUnavailable(f"version {request.submission.model_version} is not here")

        role = types.SimpleNamespace(
            models=models, config=types.SimpleNamespace(version_wait_s=60.0), runner=Runner(), checker=unavailable,
            core=types.SimpleNamespace(check_failed=lambda *a: []),
            relay=types.SimpleNamespace(watcher=_Watcher(), core=types.SimpleNamespace(knows=lambda v: v == 100)))
        role._may_come = lambda version: ValidatorRole._may_come(role, version)
        for version in (10**12, 5, 4, 100):  # far future, two ahead; the next one; one whose manifest we know
            request = CheckRequested(b"\x00" * 32, WORKER.peer_id,
                                     dataclasses.replace(submission(step=1), model_version=version), b"", (0,))
            start = trio.current_time()
            await ValidatorRole._check(role, request)
            spent[version] = trio.current_time() - start
        assert len(failed) == 4  # each dropped as model_unavailable, after its wait or at once
        return spent

    spent = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert spent == {10**12: 0.0, 5: 0.0, 4: 60.0, 100: 60.0}


def test_remote_claims_remembered_are_bounded(monkeypatch):
    """A claim may come before its submission, so claims for ids not seen are kept a while; a
    validator (any peer saying so, in an open network) sending claims for made-up ids fills no more
    than MAX_CLAIMS."""
    import verify.validator
    from p2pnet.identity import Identity
    from tests.verify.test_validator_core import V2, FakeDirectory
    from verify.assign import make_ticket
    from verify.messages import Claim

    monkeypatch.setattr(verify.validator, "MAX_CLAIMS", 8)
    core = core_for(V1, FakeDirectory({WORKER: ("worker",), V1: ("validator",), V2: ("validator",)}))
    for i in range(40):
        sid = Identity.from_seed_text(f"sid{i}").peer_id.encode()[:32]
        core.on_message(1.0 + i, envelope(V2, Claim(sid, make_ticket(V2, sid))))
    assert 0 < len(core._claims) <= 8

"""The serving core forgets requests that wait for a chunk we do not hold yet, one by one (a
requester's connection closing cancels each of its turns), by peer, at their wait limit, or all
at once; what is left is served when the chunk arrives, nothing twice and nothing lost."""

from __future__ import annotations

from relay.serving import Refuse, Serve, ServingConfig, ServingCore


def waiting_core(count: int) -> tuple[ServingCore, list[object]]:
    core = ServingCore(ServingConfig(wait_limit_s=10.0))
    tokens = [object() for _ in range(count)]
    for i, token in enumerate(tokens):  # three requesters; chunks 0 and 1 of version 1, not held
        assert core.ask(0.0, token, f"peer-{i % 3}", 1, i % 2, False, held=False) == []
    return core, tokens


def test_cancelled_waits_are_forgotten_and_the_rest_served_when_the_chunk_arrives():
    core, tokens = waiting_core(12)
    for token in tokens[:6]:
        core.cancel(token)
    core.cancel(tokens[0])  # twice: nothing more happens
    core.cancel(object())  # never asked
    assert core.status()["waiting"] == 6
    served = core.arrived(1.0, 1, 0) + core.arrived(1.0, 1, 1)
    assert {a.token for a in served} == set(tokens[6:]) and all(isinstance(a, Serve) for a in served)
    assert core.status()["waiting"] == 0
    assert core.expire(20.0) == []  # none of them comes back at its wait limit


def test_waits_forgotten_by_peer_by_wait_limit_or_all_at_once_cannot_be_cancelled_again():
    core, tokens = waiting_core(12)
    dropped = core.drop_peer("peer-0")
    assert set(dropped) == {t for i, t in enumerate(tokens) if i % 3 == 0}
    for token in dropped:
        core.cancel(token)
    core.cancel(tokens[1])
    refused = core.expire(10.0)
    assert {a.token for a in refused} == {t for i, t in enumerate(tokens) if i % 3 != 0 and t is not tokens[1]}
    assert all(isinstance(a, Refuse) for a in refused) and core.status()["waiting"] == 0
    for token in tokens:
        core.cancel(token)
    core2, tokens2 = waiting_core(6)
    assert set(core2.clear()) == set(tokens2)
    for token in tokens2:
        core2.cancel(token)
    assert core2.arrived(1.0, 1, 0) == [] and core2.status()["waiting"] == 0

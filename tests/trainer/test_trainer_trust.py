"""The trainer's intake believes what its settings say, as validators' do: which peers' verdicts
count (a sock puppet whose heartbeat says "validator" got a cheat's batch trained), how many
validators a ban needs and how long it lasts (one validator banned a worker for good, and the ban
outlived restarts)."""

from __future__ import annotations

import pytest

from p2pnet.config import from_mapping
from p2pnet.errors import ConfigError
from tests.trainer.test_intake import CHEAT, STRANGER, VALIDATOR, Directory, Entry, submit, verdict
from trainer.intake import Intake
from trainer.roles import TrainerConfig


def intake_from(section: dict) -> Intake:
    config = from_mapping(TrainerConfig, {"model_dir": "/m", "out_dir": "/o", **section}, "trainer")
    directory = Directory()
    directory.entries[STRANGER.peer_id] = Entry(STRANGER.peer_id, ("validator",))  # says so in its heartbeat
    return Intake(config.intake_config(), "trainer-id", directory)


def test_only_the_listed_validators_verdicts_count():
    intake = intake_from({"validators": [VALIDATOR.peer_id]})
    _, sid = submit(intake, CHEAT, 0)
    verdict(intake, sid, CHEAT, 0, True, sender=STRANGER)  # the sock puppet accepts the cheat's batch
    assert intake.admissible(3.0, 0) == []
    verdict(intake, sid, CHEAT, 0, True, sender=VALIDATOR)
    assert [b.sid for b in intake.admissible(3.0, 0)] == [sid]
    anyone = intake_from({})  # unlisted: any peer whose heartbeat says validator (the default)
    _, sid = submit(anyone, CHEAT, 0)
    verdict(anyone, sid, CHEAT, 0, True, sender=STRANGER)
    assert [b.sid for b in anyone.admissible(3.0, 0)] == [sid]


def test_a_ban_needs_as_many_validators_as_set_and_lasts_as_long():
    intake = intake_from({"ban_after_failures": 1, "ban_min_validators": 2, "ban_s": 60.0})
    _, sid = submit(intake, CHEAT, 0)
    verdict(intake, sid, CHEAT, 0, False, sender=VALIDATOR, now=2.0)
    assert not intake.reputation.is_banned(CHEAT.peer_id, 2.0)  # one validator's word is not enough
    _, sid = submit(intake, CHEAT, 1, now=3.0)
    verdict(intake, sid, CHEAT, 1, False, sender=STRANGER, now=4.0)
    assert intake.reputation.is_banned(CHEAT.peer_id, 4.0)
    assert not intake.reputation.is_banned(CHEAT.peer_id, 4.0 + 61.0)  # for ban_s, not for good


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="ban_min_validators"):
        from_mapping(TrainerConfig, {"model_dir": "/m", "out_dir": "/o", "ban_min_validators": 0}, "trainer")

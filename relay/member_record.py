"""The relay's record on disk of how long its members have been members, kept across its restarts.

The transfer core counts how long each relay member has been one (`relay.manifest_standing`:
members settled before a version was first asked for stand in line for its manifest before
identities that joined since); a restart would make every member a newcomer again, and one
whose heartbeat reaches us after the liars' would wait behind them. The relay role keeps the
core's `members_seen` in `MEMBERS_FILE` under its data directory (`save`, every `SAVE_EVERY_S`,
written whole to a temporary file and renamed over the old one, so a crash leaves one or the
other) and gives it back to the core at start (`load`, `TransferCore.recall_members`).

One JSON object: {"members": {peer id: seconds it had been a member}}; at most
`relay.manifest_standing.MAX_RECALLED` entries (about 100 bytes each), the longest kept. A file
that is missing is no record (a first start); one that does not parse, or holds anything else,
is no record either, and `load` says so (`MemberRecordUnreadable`): the caller logs it and goes
on, as after a first start: the record only orders manifest asks.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from relay.manifest_standing import MAX_RECALLED

MEMBERS_FILE = "relay-members.json"
SAVE_EVERY_S = 60.0  # how often the role writes the record (a member's time since is lost at a crash)


class MemberRecordUnreadable(Exception):
    """The record on disk is there but is not one `save` wrote (a broken disk, a hand edit)."""


def save(path: Path, ages: dict[str, float]) -> None:
    """Write the record: `ages` (member -> seconds a member), the longest `MAX_RECALLED`."""
    longest = sorted(ages.items(), key=lambda item: -item[1])[:MAX_RECALLED]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"members": {peer: round(age, 3) for peer, age in longest}}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path) -> dict[str, float]:
    """The record (member -> seconds it had been a member), as the file holds it (the core
    keeps the longest `MAX_RECALLED`: `recall_members`); empty if there is none. Raises
    `MemberRecordUnreadable` if the file is not one `save` wrote."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        members = json.loads(raw.decode("utf-8"))["members"]
        ages = {str(peer): float(age) for peer, age in members.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MemberRecordUnreadable(f"{path}: {e}") from e
    if not all(math.isfinite(age) and age >= 0 for age in ages.values()):
        raise MemberRecordUnreadable(f"{path}: an age that is no number of seconds")
    return ages

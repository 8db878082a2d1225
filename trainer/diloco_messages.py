"""The wire messages of DiLoCo rounds, sent on the `diloco` data channel with the one codec.

Every frame is signed by its sender's identity key (`p2pnet.wire`), so a contribution is
attributable: what fails its checks costs the peer that signed it.

A round's connections (`trainer.diloco_links`) carry Join, Members, Part and NoRoom one way;
the receiving end writes on one only to close it idle (`Idle`), and only when the sender's frames
said it reads that (`hears_idle`, a field added at the end with a default, so older peers send
and read these messages as before: an older sender's frames lack it and read as False). A Join
whose round had no room for it is answered `NoRoom` only when the Join said its sender reads
that (`hears_no_room`, added the same way): to an older peer, whose server ends a connection on a
frame of a kind it does not know, it is never sent. A `StateRequest` the receiver has no room to
hold is answered `HoldsFull` only when the request said its asker reads that (`hears_full`, added
the same way): an older asker would take a frame of a kind it does not know for a bad state, and
sees the bare close it always saw.

This module must not do I/O or know how a round proceeds (`trainer.allreduce` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pnet.wire import message

CHANNEL = "diloco"
PIECE_VALUES = 256 * 1024  # values per Part: 256 KiB as int8, 1 MiB as fp32 (a multiple of any block below)
MAX_PART_BYTES = 2 * 1024 * 1024
MAX_MEMBERS = 256  # the most peers a Join names or a round's Members lists: the largest group a round can hold
STAGE_CONTRIBUTION = 0  # a peer's pseudo-gradient for one shard, to the shard's owner
STAGE_REDUCED = 1  # the owner's mean of one shard, to every member


@dataclass(frozen=True)
class Join:
    """`sender` finished its inner steps of `round`, starting from global weights whose
    digest is `weights_digest` (16 bytes), and asks to take part in the all-reduce. `known`
    are the trainer peers it knows of: the receiver waits for their Joins too.

    `hears_idle` (Join, Members and Part alike): the connection this came on reads what the
    receiver writes, and takes an `Idle` there for a close that is no death (a newer sender's
    `Links` sets it on every frame). False, as in every older peer's frames, the receiver closes
    that connection idle without a word, as any close. It says nothing about the round, so two
    messages that differ only in it are equal.

    `hears_no_room` (a newer sender's, set on its Joins of a round it decides): it takes a
    `NoRoom` answer to this Join. False, as in every older peer's, it is not sent one. Not
    compared either."""

    round: int
    weights_digest: bytes
    known: tuple[str, ...]
    hears_idle: bool = field(default=False, compare=False)  # its link reads an Idle notice (above)
    hears_no_room: bool = field(default=False, compare=False)  # its sender takes a NoRoom answer (below)

    def __post_init__(self) -> None:
        if self.round < 0 or len(self.weights_digest) != 16:
            raise ValueError("a Join needs round >= 0 and a 16-byte digest")
        if len(self.known) > MAX_MEMBERS or any(len(p) > 64 for p in self.known):
            raise ValueError(f"a Join names at most {MAX_MEMBERS} known peers")


@dataclass(frozen=True)
class Members:
    """The round's leader decided: `members` (sorted) average this round, all starting from
    the global weights whose digest is `weights_digest`. `hears_idle`: as in `Join`."""

    round: int
    weights_digest: bytes
    members: tuple[str, ...]
    hears_idle: bool = field(default=False, compare=False)  # as in Join

    def __post_init__(self) -> None:
        if self.round < 0 or len(self.weights_digest) != 16 or not self.members:
            raise ValueError("Members needs round >= 0, a 16-byte digest and at least one member")
        if len(self.members) > MAX_MEMBERS or list(self.members) != sorted(set(self.members)):
            raise ValueError(f"members must be sorted, unique, at most {MAX_MEMBERS}")


@dataclass(frozen=True)
class Part:
    """One piece of one shard. `offset` and `length` are in values, within the shard of
    `shard_length` values; `values`/`scales` are a `trainer.diloco.Packed` of that piece, their
    sizes those of `length` values in `encoding` (int8: `length` bytes and 4 a block of `block`
    values, fp32: 4 a value and no scales): a frame whose bytes say otherwise is refused when
    decoded, so a Part never holds more bytes than its `length` accounts for. `contributors`
    (stage REDUCED only) are the peers whose contributions were averaged: sorted, unique, at most
    `MAX_MEMBERS` peer ids (that they are members of the round is the receiving core's check,
    `trainer.allreduce`). `hears_idle`: as in `Join`."""

    round: int
    members_digest: bytes
    stage: int
    shard: int
    shard_length: int
    offset: int
    length: int
    encoding: str
    block: int
    values: bytes
    scales: bytes
    contributors: tuple[str, ...]
    hears_idle: bool = field(default=False, compare=False)  # as in Join

    def __post_init__(self) -> None:
        if self.stage not in (STAGE_CONTRIBUTION, STAGE_REDUCED):
            raise ValueError(f"unknown stage {self.stage}")
        if min(self.round, self.shard, self.offset, self.length) < 0 or self.block < 1:
            raise ValueError("negative round, shard, offset or length, or block < 1")
        if self.offset + self.length > self.shard_length or self.length > PIECE_VALUES:
            raise ValueError("piece outside its shard or too long")
        if self.encoding not in ("int8", "fp32") or len(self.members_digest) != 16:
            raise ValueError("unknown encoding or bad members digest")
        if len(self.values) != (self.length if self.encoding == "int8" else 4 * self.length):
            raise ValueError(f"{len(self.values)} value bytes for {self.length} {self.encoding} values")
        blocks = -(-self.length // self.block) if self.encoding == "int8" else 0
        if len(self.scales) != 4 * blocks:
            raise ValueError(f"{len(self.scales)} scale bytes for {blocks} {self.encoding} blocks")
        if len(self.contributors) > MAX_MEMBERS or any(len(p) > 64 for p in self.contributors):
            raise ValueError(f"at most {MAX_MEMBERS} contributors, each a peer id")
        if list(self.contributors) != sorted(set(self.contributors)):
            raise ValueError("contributors must be sorted and unique")


@dataclass(frozen=True)
class NoRoom:
    """The sender, a member of `round`, had no room for the receiver's Join of it: it holds as
    many Joins as a round takes (`MAX_MEMBERS`, the peers it keeps places for first), and turned
    that one away, or later gave its place to one of those peers (`trainer.allreduce.room_for`).
    The receiver takes it from the leader it follows (`trainer.diloco_decide`): it is no member of
    the round, stops waiting for the round's Members and takes a later state. Sent only for a Join
    that said its sender reads it (`Join.hears_no_room`). `hears_idle`: as in `Join`."""

    round: int
    hears_idle: bool = field(default=False, compare=False)  # as in Join

    def __post_init__(self) -> None:
        if self.round < 0:
            raise ValueError("NoRoom needs round >= 0")


RoundFrame = Join | Members | Part | NoRoom  # what a round's connections carry, into its inbox


@dataclass(frozen=True)
class StateRequest:
    """Ask a trainer peer for its global weights and outer momentum (a joining peer).

    `after_round` (added at the end, with a default): the asker is no member of that round (it
    was told `NoRoom`, or the round's Members left it out, on the round's weights) and wants the
    state of a later one: the receiver answers once its own state is past that round, or, if it
    is not within `trainer.diloco_state_answer.STATE_HOLD_DEADLINES` x deadline_s, with what it has
    then; one holding as many such requests as it takes (`STATE_HOLDS`, fewer for an asker it
    does not know to be of its group) refuses it (`HoldsFull`, or a bare close). -1 (an older
    asker's, which lacks it): at once. An older receiver ignores it and answers at once (the
    asker then takes the round's state again, as before).

    `hears_full` (added at the end, with a default): the asker takes a `HoldsFull` answer. False,
    as in every older asker's, a refusal is a bare close. An older receiver ignores it and refuses
    with a bare close, as before."""

    have_round: int
    after_round: int = -1
    hears_full: bool = False


@dataclass(frozen=True)
class HoldsFull:
    """The answer to a `StateRequest` for a later round's state (`after_round`) that the sender,
    at `round`, had no room to hold: it holds `held` such requests, and of the places it has left
    `kept` are kept for the members of its group (`trainer.diloco_state_answer`: `held` + `kept`
    is `STATE_HOLDS` when the asker is not known to it as one; `kept` is 0 when every place is
    taken). No one's fault: the asker asks another trainer peer at once and does not take the
    sender for failed. The sender closes the connection after it. Sent only for a request that
    said its asker reads it (`StateRequest.hears_full`)."""

    round: int
    held: int
    kept: int

    def __post_init__(self) -> None:
        if min(self.round, self.held, self.kept) < 0:
            raise ValueError("HoldsFull needs round, held and kept >= 0")


@dataclass(frozen=True)
class StatePiece:
    """One piece of the global state at the start of `round`: fp32 bytes of the weights and of
    the outer momentum from value `offset`, of `length` values out of `total` in all."""

    round: int
    total: int
    offset: int
    length: int
    weights: bytes
    momentum: bytes

    def __post_init__(self) -> None:
        if min(self.round, self.total, self.offset, self.length) < 0 or self.offset + self.length > self.total:
            raise ValueError("piece outside the state")
        if len(self.weights) != 4 * self.length or len(self.momentum) != 4 * self.length:
            raise ValueError("state piece bytes do not match its length")


@dataclass(frozen=True)
class StateWanted:
    """A trainer peer that runs the relay role asks the publishing trainer to put the outer
    optimizer state into its next published version (`trainer.diloco_join`). `have_round`: the
    round of the asker's global state; `behind_only`: only if the publisher is at a later round
    (a peer that starts, not knowing whether it is behind)."""

    have_round: int
    behind_only: bool

    def __post_init__(self) -> None:
        if self.have_round < 0:
            raise ValueError("have_round must be >= 0")


@dataclass(frozen=True)
class StateOffer:
    """The publisher's answer to StateWanted: it is at `round`; `version` (its next, `round` + 1)
    is the version that will carry the outer state, -1 when none will
    (it does not publish, finished its rounds, the asker is not behind and asked only then, is
    not a trainer peer it knows, or was offered the state within the last few rounds, as were
    too many others: `trainer.diloco_serving.ASKERS`);
    `round_s` is its last round's duration (the asker's wait scales with it)."""

    round: int
    version: int
    round_s: float

    def __post_init__(self) -> None:
        if self.round < 0 or self.version < -1 or not 0 <= self.round_s < 1e7:
            raise ValueError("an offer needs round >= 0, version >= -1 and a round time in [0, 1e7) s")


@dataclass(frozen=True)
class Idle:
    """Written by the receiving end of a round's connection, the one frame it ever writes there:
    no frame came on it for `idle_s`, and it closes the connection. Its sender forgets the link
    (its next frame opens a new connection) and does not take this for a death. Sent only when
    the connection's frames said they read it (`hears_idle`): an older sender's watcher takes any
    byte for a live peer, stops watching and would write its next frame into the closed
    connection, where a plain close tells it at once (it reports the peer failed, as before)."""

    idle_s: float

    def __post_init__(self) -> None:
        if not 0 <= self.idle_s < 1e7:
            raise ValueError("idle_s must be in [0, 1e7)")


message("diloco/join", max_bytes=MAX_MEMBERS * 64 + 1024)(Join)
message("diloco/members", max_bytes=MAX_MEMBERS * 64 + 1024)(Members)
message("diloco/part", max_bytes=MAX_PART_BYTES + 64 * 1024)(Part)
message("diloco/state_request", max_bytes=512)(StateRequest)
message("diloco/state_wanted", max_bytes=512)(StateWanted)
message("diloco/state_offer", max_bytes=512)(StateOffer)
message("diloco/idle", max_bytes=512)(Idle)
message("diloco/no_room", max_bytes=512)(NoRoom)
message("diloco/holds_full", max_bytes=512)(HoldsFull)
STATE_PIECE_VALUES = PIECE_VALUES // 4  # weights + momentum: 2 x 256 KiB per piece
message("diloco/state_piece", max_bytes=2 * 4 * STATE_PIECE_VALUES + 4096)(StatePiece)

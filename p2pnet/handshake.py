"""The data plane's handshake: both ends prove their peer ids, freshly, before any byte of data.

Theory of operation. A data connection is plain TCP (DESIGN.md, principle 3), so it carries no
identity of its own. Three frames, each a message of the one codec (so each is signed by its
sender's Ed25519 identity key, the key its peer id is made of, and stamped with its time):

    client -> server  DataHello(channel, client_nonce, server)   "I want `channel` of `server`"
    server -> client  DataChallenge(client_nonce, server_nonce)   signed by the server
    client -> server  DataProof(server_nonce, server)             signed by the client

The client believes the server once the challenge is signed by the peer id it meant to reach
and echoes its fresh `client_nonce` (a challenge signed by anyone else proves the address is
not that peer's: `WrongPeer`, and the server, seeing a hello meant for another, stops there); the server believes the client once the proof is signed by
the hello's sender and echoes its fresh `server_nonce`. A recorded hello or proof is useless
elsewhere or later: the nonces are fresh per connection and `server` names the one peer the
frames were meant for. Nothing is encrypted (checkpoints are public and every chunk is hashed
against a signed manifest); what this buys is knowing who we serve and who serves us, so
strangers get nothing and misbehaving peers can be penalised by id.

Cost per connection: one round trip and a half, three Ed25519 signatures and three checks.
The server's `admit(peer, channel)` decides after the hello, before any challenge is signed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import trio

from p2pnet.errors import MessageRejected, PeerUnavailable
from p2pnet.wire import Codec, message

NONCE_BYTES = 16
HANDSHAKE_MAX_BYTES = 1024


class WrongPeer(PeerUnavailable):
    """The address answered, but not as the peer we meant to reach: another peer, or something
    that is no p2pnet data plane (a stale or false address; the peer that advertised it is to
    blame). A refused or silent address is plain PeerUnavailable: that may be transient."""


@message("data/hello", max_bytes=HANDSHAKE_MAX_BYTES)
@dataclass(frozen=True, slots=True)
class DataHello:
    channel: str
    nonce: bytes
    server: str  # the peer id the client means to reach

    def __post_init__(self) -> None:
        if len(self.nonce) != NONCE_BYTES or not 0 < len(self.channel) <= 64 or len(self.server) > 128:
            raise ValueError("bad hello")


@message("data/challenge", max_bytes=HANDSHAKE_MAX_BYTES)
@dataclass(frozen=True, slots=True)
class DataChallenge:
    nonce: bytes  # the client's, echoed
    server_nonce: bytes

    def __post_init__(self) -> None:
        if len(self.nonce) != NONCE_BYTES or len(self.server_nonce) != NONCE_BYTES:
            raise ValueError("bad challenge")


@message("data/proof", max_bytes=HANDSHAKE_MAX_BYTES)
@dataclass(frozen=True, slots=True)
class DataProof:
    server_nonce: bytes  # the server's, echoed
    server: str

    def __post_init__(self) -> None:
        if len(self.server_nonce) != NONCE_BYTES or len(self.server) > 128:
            raise ValueError("bad proof")


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


async def _read_frame(stream: trio.abc.ReceiveStream, buffer: bytearray) -> bytes:
    """One length-prefixed frame of at most HANDSHAKE_MAX_BYTES, reading nothing beyond it."""

    async def exactly(n: int) -> bytes:
        while len(buffer) < n:
            data = await stream.receive_some(n - len(buffer))
            if not data:
                raise PeerUnavailable(f"the connection ended inside the handshake ({len(buffer)} of {n} bytes)")
            buffer.extend(data)
        out = bytes(buffer[:n])
        del buffer[:n]
        return out

    length = int.from_bytes(await exactly(4), "big")
    if length > HANDSHAKE_MAX_BYTES:
        raise MessageRejected("oversized", f"handshake frame of {length} bytes")
    return await exactly(length)


class NotAdmitted(PeerUnavailable):
    """The server closed the connection after our hello without a word: it does not admit us, at
    least not yet (a data plane serves only peers in its table that are not banned, and tells
    nobody why). A peer that heard of the server before the server heard our heartbeat gets this;
    `Node.introduce` sends the server our heartbeat directly, so a retry is admitted soon after."""


async def client_handshake(stream: trio.abc.Stream, codec: Codec, channel: str, server: str) -> None:
    """Prove ourselves to `server` on `stream` and make sure it is `server` (raises WrongPeer,
    MessageRejected, NotAdmitted or PeerUnavailable otherwise). Reads nothing beyond the challenge."""
    nonce = os.urandom(NONCE_BYTES)
    await stream.send_all(_frame(codec.encode(DataHello(channel, nonce, server), time.time())))
    buffer = bytearray()
    try:
        envelope = codec.decode(await _read_frame(stream, buffer), time.time())
    except MessageRejected as exc:  # something answered, but not a p2pnet data plane
        raise WrongPeer(f"the address answered with {exc.reason}, not a handshake") from exc
    except PeerUnavailable as exc:
        if not buffer:
            raise NotAdmitted(f"{server} closed the connection after our hello: not admitted") from exc
        raise
    challenge = envelope.body
    if envelope.sender != server:
        raise WrongPeer(f"the address answered as {envelope.sender}, not {server}")
    if not isinstance(challenge, DataChallenge) or challenge.nonce != nonce:
        raise WrongPeer(f"{server} answered our hello with something else than its challenge")
    await stream.send_all(_frame(codec.encode(DataProof(challenge.server_nonce, server), time.time())))


Admit = Callable[[str, str], "str | None"]  # (peer, channel) -> None to admit, else why not


async def server_handshake(stream: trio.abc.Stream, codec: Codec, self_id: str, admit: Admit) -> tuple[str, str]:
    """Check who the client is; returns (peer id, channel). Raises MessageRejected (bad or
    unadmitted input: the caller closes) or PeerUnavailable (the client went away)."""
    buffer = bytearray()
    envelope = codec.decode(await _read_frame(stream, buffer), time.time())
    hello = envelope.body
    if not isinstance(hello, DataHello):
        raise MessageRejected("invalid_field", "not a hello", envelope.sender)
    refusal = admit(envelope.sender, hello.channel)
    if refusal is not None:
        raise MessageRejected("not_admitted", refusal, envelope.sender)
    server_nonce = os.urandom(NONCE_BYTES)
    await stream.send_all(_frame(codec.encode(DataChallenge(hello.nonce, server_nonce), time.time())))
    if hello.server != self_id:  # our signed challenge tells the client whose address this is
        raise MessageRejected("wrong_peer", f"hello meant for {hello.server}", envelope.sender)
    proof_envelope = codec.decode(await _read_frame(stream, buffer), time.time())
    proof = proof_envelope.body
    if (proof_envelope.sender != envelope.sender or not isinstance(proof, DataProof)
            or proof.server_nonce != server_nonce or proof.server != self_id):
        raise MessageRejected("invalid_field", "the proof does not answer our challenge", envelope.sender)
    if buffer:
        raise MessageRejected("invalid_field", "bytes after the proof before the handshake ended", envelope.sender)
    return envelope.sender, hello.channel

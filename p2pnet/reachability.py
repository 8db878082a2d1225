"""Reachability: can other peers dial this peer? Learned by asking connected peers to dial back.

Theory of operation. A peer behind NAT (or a firewall) still dials out, gossips and downloads,
but nobody can open a connection to it, so it must never be planned as anyone's source. It
cannot see that from inside, so it asks: every peer runs

- a *server*: on `/p2pnet/dialback/1.0.0` it takes a signed `DialBackAsk` (nonce, data-plane
  address, libp2p addresses), dials the data plane and sends the nonce on the
  `p2pnet/dialback` channel (a correct echo proves it reached the asker's own data plane), and
  opens a TCP connection to each libp2p address; it answers `DialBackAnswer` with a
  `DialResult` for each. It only ever dials addresses at the IP the ask came from (the
  observed IP of the libp2p connection), so a stranger cannot aim its dials at a third party:
  an asker behind NAT, whose advertised private address is not where its connection comes
  from, is answered REFUSED without a dial. One ask per asker per `ASK_SPACING_S`, and at
  most `MAX_CONCURRENT_ANSWERS` dials at once (else BUSY).
- a *client*: asks up to `PROBERS` connected peers it has not asked for `interval_s`, as soon
  as it has connections (it looks every `NO_PEERS_RETRY_S` while it has none and no verdict)
  and again every `interval_s` (every `UNKNOWN_RETRY_S` while the answer is still unknown:
  `pause_s`), and keeps each peer's latest answer, for three intervals at most, in
  `ReachabilityState`, the pure part.

Verdicts, per address kind: True when any peer's latest answer is OK (one successful dial
from another host proves it; a data-plane OK counts only if our data plane echoed that ask's
nonce: the answerer knows it from the ask, so without the check one liar made a peer nobody can
dial say it is reachable), False when answers exist and none is OK, None (unknown) with
no answers. The peer is `reachable` when both kinds are True, not reachable when either is
False. The verdict goes into this peer's heartbeats (`Heartbeat.reachable`); relays plan only
peers whose heartbeat says True as parents (see `relay.role`).

py-libp2p 0.8.1 ships AutoNAT v1, but it checks only the libp2p address, waits for four
agreeing servers (a small network never decides), and its server dials back with
`host.connect`, which returns the connection the asker already has open: measured in the lab
(`scripts/autonat_check.py`), a public IP advertised with a port nobody listens on is answered
OK. Hence this check of our own, which opens new connections and covers the data plane.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import trio

from p2pnet.addresses import parse_host_port, same_ip
from p2pnet.dataplane import FrameReader, open_data_stream, send_frame
from p2pnet.errors import ConfigError, MessageRejected, PeerUnavailable
from p2pnet.messages import NONCE_BYTES, DialBackAnswer, DialBackAsk, DialResult
from p2pnet.wire import Codec

if TYPE_CHECKING:
    from p2pnet.node import Node

log = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "/p2pnet/dialback/1.0.0"
DIALBACK_CHANNEL = "p2pnet/dialback"
PROBERS = 3
UNKNOWN_RETRY_S = 2.0
# how soon a peer with no connection looks again for one to ask: it slept UNKNOWN_RETRY_S, and a
# relay started a moment before a trainer published heard the relays dialled back ~3 s later, not
# ~1 s (lab: the trainer sent the version ~2 times, `relay.requests`, "Dial-backs pending")
NO_PEERS_RETRY_S = 0.25
DIAL_TIMEOUT_S = 5.0
# an answer's dials run side by side, data plane (connect, then the echo: 2 x DIAL_TIMEOUT_S at most)
# beside the libp2p addresses (DIAL_TIMEOUT_S): it comes within the ask's deadline, with room for the
# way there and back (dialled one after another, an asker that drops SYNs got none, and stayed unknown)
ASK_TIMEOUT_S = 3 * DIAL_TIMEOUT_S
ASK_SPACING_S = 5.0
MAX_CONCURRENT_ANSWERS = 8
KEEP_ANSWERS = 8


@dataclass(frozen=True)
class Answer:
    at: float
    data: DialResult
    libp2p: DialResult


def _verdict(results: list[DialResult]) -> bool | None:
    informative = [r for r in results if r is not DialResult.BUSY]
    if not informative:
        return None
    return DialResult.OK in informative


class ReachabilityState:
    """The pure part: who was asked when, their latest answers, and the verdicts."""

    def __init__(self, keep: int = KEEP_ANSWERS) -> None:
        self._keep = keep
        self._answers: dict[str, Answer] = {}
        self._asked: dict[str, float] = {}

    def probers(self, now: float, connected: list[str], interval_s: float, want: int = PROBERS) -> list[str]:
        """Connected peers to ask now: not asked within `interval_s`, least recently asked first."""
        due = [p for p in connected if now - self._asked.get(p, -float("inf")) >= interval_s]
        due.sort(key=lambda p: (self._asked.get(p, -float("inf")), p))
        chosen = due[:want]
        for peer in chosen:
            self._asked[peer] = now
        if len(self._asked) > 4 * self._keep:  # forget the longest-ago asks, keep memory flat
            for peer in sorted(self._asked, key=self._asked.__getitem__)[: len(self._asked) - 4 * self._keep]:
                del self._asked[peer]
        return chosen

    def expire(self, now: float, max_age_s: float) -> None:
        """Forget answers older than `max_age_s`: a verdict rests on recent dials only."""
        for peer in [p for p, a in self._answers.items() if now - a.at > max_age_s]:
            del self._answers[peer]

    def record(self, now: float, peer: str, data: DialResult, libp2p: DialResult) -> None:
        if data is DialResult.BUSY and libp2p is DialResult.BUSY:
            return
        self._answers[peer] = Answer(now, data, libp2p)
        if len(self._answers) > self._keep:
            oldest = min(self._answers, key=lambda p: self._answers[p].at)
            del self._answers[oldest]

    @property
    def data(self) -> bool | None:
        return _verdict([a.data for a in self._answers.values()])

    @property
    def libp2p(self) -> bool | None:
        return _verdict([a.libp2p for a in self._answers.values()])

    @property
    def reachable(self) -> bool | None:
        data, libp2p = self.data, self.libp2p
        if data is False or libp2p is False:
            return False
        if data and libp2p:
            return True
        return None

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "reachable": self.reachable,
            "data": self.data,
            "libp2p": self.libp2p,
            "answers": {peer: {"data": a.data.name.lower(), "libp2p": a.libp2p.name.lower(),
                               "s_ago": round(now - a.at, 1)} for peer, a in sorted(self._answers.items())},
        }


def pause_s(connected: bool, verdict: bool | None, interval_s: float) -> float:
    """How long the client waits before it looks again for peers to ask: `interval_s` once it has a
    verdict, `UNKNOWN_RETRY_S` while it has none, and `NO_PEERS_RETRY_S` while it has none and
    nobody to ask either (it asks as soon as it has connections: see the top)."""
    if verdict is not None:
        return interval_s
    return UNKNOWN_RETRY_S if connected else NO_PEERS_RETRY_S


class Reachability:
    """The trio shell: serves dial-backs for others and asks others about us."""

    def __init__(self, node: Node, interval_s: float) -> None:
        self.node = node
        self.interval_s = interval_s
        self.state = ReachabilityState()
        self._pending: dict[bytes, bool] = {}  # nonces of our asks out -> echoed on our data plane yet
        self._last_ask: dict[str, float] = {}
        self._answering = trio.CapacityLimiter(MAX_CONCURRENT_ANSWERS)
        node.host.set_request_handler(DIALBACK_PROTOCOL, self._answer, timeout_s=ASK_TIMEOUT_S)
        node.dataplane.register(DIALBACK_CHANNEL, self._echo, known_only=False)  # before its heartbeat reaches us

    def status(self) -> dict[str, Any]:
        return self.state.to_json(trio.current_time())

    # -- client ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            now = trio.current_time()
            self.state.expire(now, 3 * self.interval_s)
            connected = self.node.host.connected_peers()
            probers = self.state.probers(now, connected, self.interval_s)
            if probers:
                async with trio.open_nursery() as nursery:
                    for peer in probers:
                        nursery.start_soon(self._probe, peer)
                await self._publish_verdict()
            await trio.sleep(pause_s(bool(connected), self.state.reachable, self.interval_s))

    async def _probe(self, peer: str) -> None:
        nonce = os.urandom(NONCE_BYTES)
        self._pending[nonce] = False
        try:
            ask = DialBackAsk(nonce, self.node.dataplane.address, tuple(self.node.host.addrs()))
            frame = await self.node.host.request(peer, DIALBACK_PROTOCOL, self.node.codec.encode(ask, time.time()),
                                                 timeout_s=ASK_TIMEOUT_S)
            envelope = self.node.codec.decode(frame, time.time())
            answer = envelope.body
            if envelope.sender != peer or not isinstance(answer, DialBackAnswer) or answer.nonce != nonce:
                raise MessageRejected("invalid_field", "not an answer to our dial-back ask", peer)
            if answer.data == DialResult.OK and not self._pending[nonce]:  # (it had the nonce from our ask)
                raise MessageRejected("invalid_field", "a data-plane dial-back answered OK that never reached "
                                      "us: nothing echoed its nonce", peer)
            self.state.record(trio.current_time(), peer, DialResult(answer.data), DialResult(answer.libp2p))
        except (PeerUnavailable, MessageRejected) as exc:
            log.debug("dial-back ask to %s: %s", peer, exc)
        finally:
            self._pending.pop(nonce, None)

    async def _publish_verdict(self) -> None:
        table = self.node.peertable
        verdict = self.state.reachable
        if verdict == table.local.reachable:
            return
        table.set_local(replace(table.local, reachable=verdict))  # from the next heartbeat on
        if verdict is False:
            log.warning("other peers cannot dial this peer (data plane %s: %s, libp2p %s: %s); it will download "
                        "but never serve. Behind NAT? Forward ports and set --announce/--data-announce.",
                        self.node.dataplane.address, _word(self.state.data),
                        ",".join(self.node.host.addrs()), _word(self.state.libp2p))
        elif verdict is True:
            log.info("reachable: other peers dialled this peer back")

    async def _echo(self, stream: trio.SocketStream, reader: FrameReader, peer: str) -> None:
        """Data-plane side of a dial-back: echo a nonce we are waiting for, and nothing else."""
        with trio.move_on_after(DIAL_TIMEOUT_S):
            nonce = await reader.frame()
            if nonce is not None and nonce in self._pending:
                self._pending[nonce] = True  # an OK to this ask is believed (`_probe`)
                await send_frame(stream, nonce)

    # -- server ---------------------------------------------------------------------------

    async def _answer(self, frame: bytes, peer: str, observed_ip: str | None) -> bytes | None:
        envelope = self.node.codec.decode(frame, time.time())
        ask = envelope.body
        if envelope.sender != peer or not isinstance(ask, DialBackAsk):
            raise MessageRejected("invalid_field", "dial-back ask not from the stream's peer", peer)
        now = trio.current_time()
        busy = now - self._last_ask.get(peer, -float("inf")) < ASK_SPACING_S or observed_ip is None
        if not busy:
            self._last_ask[peer] = now
            if len(self._last_ask) > 1024:
                self._last_ask = {p: t for p, t in self._last_ask.items() if now - t < ASK_SPACING_S}
        if busy or observed_ip is None or self._answering.borrowed_tokens >= self._answering.total_tokens:
            answer = DialBackAnswer(ask.nonce, DialResult.BUSY, DialResult.BUSY)
        else:
            results: dict[str, DialResult] = {}

            async def dial(kind: str, dialling: Any) -> None:
                results[kind] = await dialling

            async with self._answering, trio.open_nursery() as dials:  # side by side: within the ask's deadline
                dials.start_soon(dial, "data", dial_data(ask.data_addr, observed_ip, ask.nonce, self.node.codec, peer))
                dials.start_soon(dial, "libp2p", dial_libp2p(ask.addrs, observed_ip))
            answer = DialBackAnswer(ask.nonce, int(results["data"]), int(results["libp2p"]))
        return self.node.codec.encode(answer, time.time())


async def dial_data(data_addr: str, observed_ip: str, nonce: bytes, codec: Codec, peer: str) -> DialResult:
    """Dial `data_addr` if it is at `observed_ip`; OK only if the data plane there proves to be
    `peer`'s (the handshake) and echoes `nonce`."""
    try:
        host, _ = parse_host_port(data_addr, "data_addr")
    except ConfigError:
        return DialResult.REFUSED
    if not same_ip(host, observed_ip):
        return DialResult.REFUSED
    try:
        stream = await open_data_stream(data_addr, DIALBACK_CHANNEL, codec=codec, peer=peer, timeout_s=DIAL_TIMEOUT_S)
    except PeerUnavailable:
        return DialResult.FAILED
    async with stream:
        try:
            with trio.fail_after(DIAL_TIMEOUT_S):
                await send_frame(stream, nonce)
                echoed = await FrameReader(stream, max_frame_bytes=NONCE_BYTES).frame()
        except (trio.TooSlowError, trio.BrokenResourceError, PeerUnavailable, MessageRejected, OSError):
            return DialResult.FAILED
    return DialResult.OK if echoed == nonce else DialResult.FAILED


async def dial_libp2p(addrs: tuple[str, ...], observed_ip: str) -> DialResult:
    """Open a TCP connection to each of `addrs` at `observed_ip` (at most 4, side by side, each
    within `DIAL_TIMEOUT_S`); OK if one accepts."""
    candidates = []
    for addr in addrs:
        parts = addr.split("/")
        if (len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp"
                and parts[4].isascii() and parts[4].isdigit() and int(parts[4]) < 65536):  # the asker's text
            if same_ip(parts[2], observed_ip):
                candidates.append((parts[2], int(parts[4])))
    if not candidates:
        return DialResult.REFUSED
    accepted = []

    async def attempt(ip: str, port: int, dials: trio.CancelScope) -> None:
        with trio.move_on_after(DIAL_TIMEOUT_S):
            try:
                stream = await trio.open_tcp_stream(ip, port)
            except OSError:
                return
            await stream.aclose()
            accepted.append((ip, port))
            dials.cancel()  # one is enough

    async with trio.open_nursery() as nursery:
        for ip, port in candidates[:4]:
            nursery.start_soon(attempt, ip, port, nursery.cancel_scope)
    return DialResult.OK if accepted else DialResult.FAILED


def _word(value: bool | None) -> str:
    return {True: "ok", False: "not dialable", None: "unknown"}[value]

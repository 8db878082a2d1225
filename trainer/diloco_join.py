"""How a joining DiLoCo trainer peer gets the global state through the relay.

Theory of operation. The global state of a round is the global weights, the outer momentum
and the round number. The weights already travel to every relay as the publisher's version
`round`; the momentum is as large as the weights in fp32 and only a trainer peer needs it, so
it rides along only when someone asked for it:

1. the joiner (a fresh peer, a restarted one, or one that found itself behind) runs the relay
   role and trusts the publisher; it sends `StateWanted(have_round)` to the publisher on the
   diloco channel and gets a `StateOffer`: the publisher's round, the first version that will
   carry the outer state (-1: none will) and its recent round time;
2. the publisher writes `OUTER_STATE_FILE` (momentum, round, weights digest) next to the
   model files of the offered version (its next one, at the end of the round in progress) and
   signs it into the version's manifest like any other file; from that round on it waits for
   the joiner's Join as for a peer that fetched the state directly;
3. the joiner's own relay role fetches that version as it fetches every version; the joiner
   waits (up to `wait_s`, which scales with the round time and the deadline) until the offered
   version (or a later one with the file) is complete in its store, then loads the
   weights into its model and the momentum from the file, both memory-mapped from verified
   chunks (`relay.loader`), and checks the weights' digest against the one the file names.

Inference workers fetch that version whole, so it is larger for them by the momentum (4 bytes
a value plus a small header) in rounds where somebody joined, and by nothing in other rounds.
Their loaders skip the file: it is safetensors inside but not named `*.safetensors`, and every
weight loader here (`relay.loader`, `models.weights.stream_tensors`, from_pretrained) reads only
files so named.

The role falls back to the direct fetch (`StateRequest`) when this path gives nothing: no
relay role or no trusted publisher among the live trainer peers, a publisher that does not
answer or does not publish, or no version with the state by the deadline.

This module must not decide rounds or members (`trainer.diloco_role` does).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import trio

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import MessageRejected, PeerUnavailable
from p2pnet.files import atomic_write_bytes
from p2pnet.handshake import NotAdmitted
from relay.errors import VersionUnloadable
from relay.loader import LOAD_FAILURES
from trainer.diloco import digest
from trainer.diloco_local import GlobalState
from trainer.diloco_messages import StateOffer, StateWanted

if TYPE_CHECKING:
    from trainer.diloco_role import DilocoRole

log = logging.getLogger(__name__)

OUTER_STATE_FILE = "diloco_outer_state.st"  # safetensors inside; not *.safetensors, so no weight loader takes it
FORMAT = "p2pnet-diloco-outer/1"


# -- the file -------------------------------------------------------------------------------------


def write_outer_state(folder: Path, state: GlobalState) -> Path:
    """Write `state`'s momentum, round and weights digest as folder/OUTER_STATE_FILE, durably."""
    from safetensors.torch import save

    final = folder / OUTER_STATE_FILE
    atomic_write_bytes(final, save({"momentum": state.momentum.to(torch.float32).contiguous()},
                                   metadata={"format": FORMAT, "round": str(state.round),
                                             "weights_digest": digest(state.weights).hex()}))
    return final


def read_outer_state(path: Path) -> tuple[int, bytes, torch.Tensor]:
    """(round, weights digest, momentum) of an outer state file; ValueError when it is not one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if meta.get("format") != FORMAT or set(handle.keys()) != {"momentum"}:
                raise ValueError(f"{path.name} is not a {FORMAT} file")
            momentum = handle.get_tensor("momentum")
        return int(meta["round"]), bytes.fromhex(meta["weights_digest"]), momentum
    except (SafetensorError, OSError, KeyError) as exc:
        raise ValueError(f"{path.name}: {exc}") from exc


def state_file_of(store: Any, version: int) -> Path | None:
    """The outer state file of a version held in `store`, or None when it has none."""
    signed = store.manifest(version)
    for entry, path in zip(signed.manifest.files, store.version_files(version)):
        if entry.name == OUTER_STATE_FILE:
            return path
    return None


def load_from_version(inner: Any, store: Any, version: int) -> GlobalState:
    """The global state a complete version carries (run in a thread): its weights loaded into
    `inner`'s model (every chunk hashed again first), its momentum from the outer state file.
    VersionUnloadable (the publisher's fault) when they do not fit or do not agree; a
    `LocalStateError` when a chunk rotted here. On failure the model may hold part of the
    version: the caller loads its own weights back."""
    from relay.loader import load_into

    torch.set_num_threads(1)
    publisher = store.manifest(version).publisher
    path = state_file_of(store, version)
    if path is None:
        raise VersionUnloadable(version, f"carries no {OUTER_STATE_FILE}", publisher)
    load_into(inner.model, store, version)  # verifies every chunk of the version, the state file's too
    weights = inner.weights()
    try:
        round, weights_digest, momentum = read_outer_state(path)
    except ValueError as exc:
        raise VersionUnloadable(version, str(exc), publisher) from exc
    if round != version or momentum.numel() != weights.numel():
        raise VersionUnloadable(version, f"outer state of round {round} with {momentum.numel()} values "
                                f"for version {version} of {weights.numel()}", publisher)
    if digest(weights) != weights_digest or not bool(torch.isfinite(momentum).all()):
        raise VersionUnloadable(version, "weights digest differs from the outer state's, or momentum not finite",
                                publisher)
    return GlobalState(round, weights, momentum.reshape(-1).clone())


# -- the shell ------------------------------------------------------------------------------------


async def ask_publisher(role: DilocoRole, publisher: str, wanted: StateWanted) -> StateOffer:
    """Send `wanted` to `publisher` and return its offer (a direct message on the diloco channel).

    A joiner often hears of the publisher (through another peer's gossip) before the publisher
    hears its heartbeat, and a data plane serves only peers in its table: it closes the
    connection without a word (`NotAdmitted`). Each refusal sends the publisher our latest heartbeat
    directly (`Node.introduce`: otherwise it would wait for our next one, up to the peer table's
    `max_interval_s` in a large network), and the ask is tried again every heartbeat interval (or
    when a slower introduction ends, never past the deadline) until the deadline, while the
    publisher is in our table; any other failure, or the deadline, makes this path fail at once."""
    give_up = trio.current_time() + role.config.deadline_s
    while True:
        try:
            stream = await role.open_stream(publisher)
            break
        except NotAdmitted as exc:
            interval = role.node.peertable.config.heartbeat_interval_s
            if trio.current_time() + interval > give_up or role.node.peertable.get(publisher) is None:
                raise
            log.info("diloco: %s did not admit us yet (%s); trying again in %.1f s", publisher, exc, interval)
            again = trio.current_time() + interval
            with trio.move_on_at(give_up):  # a dial may take the node's `send_timeout_s`: not past our deadline
                await role.node.introduce(publisher)  # our heartbeat, so the next try is admitted
            await trio.sleep_until(again)
    async with stream:
        with trio.fail_after(role.config.deadline_s):
            await send_frame(stream, role.node.codec.encode(wanted, time.time()))
            frame = await FrameReader(stream, max_frame_bytes=4096).frame()
    if frame is None:
        raise PeerUnavailable(f"{publisher} closed the connection instead of answering StateWanted")
    offer = role.node.codec.decode(frame, time.time()).body
    if not isinstance(offer, StateOffer):
        raise MessageRejected("unexpected", f"{publisher} answered StateWanted with {type(offer).__name__}", publisher)
    return offer


def wait_s(offer: StateOffer, deadline_s: float) -> float:
    """How long a joiner waits for the offered version: the publisher's round in progress and the
    next one (a round with a death takes up to two deadlines more), then writing and relaying it."""
    return 3 * offer.round_s + 4 * deadline_s


async def state_via_relay(role: DilocoRole, publisher: str, have_round: int, *, behind_only: bool) -> GlobalState | None:
    """The global state of the version the publisher offers (or a later one that carries the outer
    state), from our relay store; None when the publisher offers none (it is not ahead and `behind_only`).
    Raises PeerUnavailable / MessageRejected / trio.TooSlowError when this path failed."""
    relay = role.relay
    assert relay is not None and role.inner is not None
    offer = await ask_publisher(role, publisher, StateWanted(have_round, behind_only))
    if offer.version < 0:
        if behind_only and offer.round <= have_round:
            return None
        raise PeerUnavailable(f"{publisher} will not publish the outer state (at round {offer.round})")
    limit_s = wait_s(offer, role.config.deadline_s)
    log.info("diloco: %s puts the outer state in version %d; waiting for it in our store (up to %.0f s)",
             publisher, offer.version, limit_s)
    with trio.fail_after(limit_s):
        while True:
            held = [v for v in relay.watcher.complete_versions() if v >= offer.version]
            with_state = [v for v in held if _has_state(relay.store, v)]
            for version in sorted(with_state, reverse=True):
                try:
                    return await trio.to_thread.run_sync(load_from_version, role.inner, relay.store, version)
                except LOAD_FAILURES as exc:
                    log.warning("diloco: version %d does not give the global state: %s", version, exc)
                    role.inner.load(role.state.weights)  # type: ignore[union-attr]
            if offer.version in held and offer.version not in with_state:
                raise PeerUnavailable(f"version {offer.version} arrived without the outer state")
            if (held and not with_state and offer.version not in relay.store.versions()
                    and not relay.store.should_fetch(offer.version)):
                # later versions are complete and the store will not keep (or take) the offered one
                raise PeerUnavailable(f"version {min(held)} is complete here and version {offer.version} "
                                      "with the outer state is dropped")
            if with_state:  # every one failed to load: the direct path decides
                raise PeerUnavailable("no version with the outer state loaded")
            await relay.watcher.wait_change()


def _has_state(store: Any, version: int) -> bool:
    try:
        return state_file_of(store, version) is not None
    except LOAD_FAILURES:
        return False  # collected meanwhile

"""Wire messages and their one codec: typed frozen bodies in signed, versioned envelopes.

Theory of operation. A message body is a frozen dataclass registered with `@message(kind,
max_bytes=...)`. On the wire it travels inside an envelope:

    frame   = payload || signature (64 bytes, Ed25519)
    payload = canonical CBOR of [WIRE_VERSION, kind, sender peer id bytes, ts_ms, [fields...]]
    signed  = DOMAIN || payload

Fields are encoded positionally in declaration order, so the encoding is deterministic and
compact. Decoding checks, in order: total size against the global cap; well-formed CBOR (tags
are refused); version; known kind; size against that kind's cap; the signature against the key
inlined in the sender's peer id; the timestamp against the receiver's clock; then every field's
type, and the body's own `__post_init__` invariants. Any failure raises `MessageRejected` with
a stable `reason`; nothing else escapes `decode`.

Evolution: two versions of the peer talk to each other. Peers upgrade at their own pace, so a
message may come from a peer that declares one field more or one field less than we do. The
rule, the same for every message and every nested dataclass (struct) inside one:

- A field may be added only at the END of a message or struct, and only with a default (a
  dataclass default or default_factory). Registration refuses what it can see breaks this:
  keyword-only fields (they have no position), and a default the wire cannot carry as it is
  (a value that does not survive encoding and decoding unchanged: an old peer's message would
  read as something no peer can say); a field without a default after one with a default is
  already a dataclass error.
- A new peer decoding an old peer's message finds trailing fields missing: each missing field
  takes its default. Fewer fields than the leading fields without a default is `invalid_field`.
- An old peer decoding a new peer's message finds trailing fields it does not know: it ignores
  them. They are not type-checked (it cannot know their types) but they were decoded as
  well-formed CBOR with the rest of the payload, counted against the kind's `max_bytes`, and
  signed with it, so ignoring them costs no authenticity. No separate bound on their number:
  the frame's size cap already bounds the bytes and the decode already paid for them.
- Fixed-size tuples (`tuple[str, int]`) are values, not structs: their length stays exact.

So an old peer never sees the new field (it behaves as it did), and a new peer sees the
default in an old peer's message: a default must therefore mean "the sender did not say"
(`Heartbeat.interval_ms = 0`: not declared). What still needs a WIRE_VERSION bump (and a
network that upgrades together): removing, reordering or retyping a field, giving a field
without a default, or changing what an existing field means.

Re-encoding a decoded body is not what its sender signed: an old peer re-encodes without the
fields it ignored, a new one with defaults the sender never sent. Whatever hashes or checks a
signature over a message must use the payload as received: `Envelope.payload` holds it
(`signed_payload(envelope)`; verify's submission id hashes it). Objects that carry their own
signature carry their signed bytes (`relay.manifest.SignedManifest.frame`, hashed for the
manifest id and forwarded as is), never a re-encoding.

This module must not do I/O and must not know what any message means.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import cbor2

from p2pnet.errors import MessageRejected, StaleMessage
from p2pnet.identity import Identity, SignatureChecker, peer_id_to_str

WIRE_VERSION = 1
DOMAIN = b"p2pnet/msg/v1\x00"
SIGNATURE_BYTES = 64
MAX_FRAME_BYTES = 4 * 1024 * 1024
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # signed or unsigned 64-bit

T = TypeVar("T")


@dataclass(frozen=True)
class MessageSpec:
    kind: str
    cls: type
    max_bytes: int
    to_wire: Callable[[Any], list]
    from_wire: Callable[[Any], Any]


_REGISTRY: dict[str, MessageSpec] = {}
_BY_CLASS: dict[type, MessageSpec] = {}


def message(kind: str, *, max_bytes: int) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as a wire message of `kind`, at most `max_bytes` framed."""

    def register(cls: type[T]) -> type[T]:
        if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        if kind in _REGISTRY:
            raise TypeError(f"message kind {kind!r} registered twice")
        if not 0 < max_bytes <= MAX_FRAME_BYTES:
            raise TypeError(f"max_bytes of {kind!r} must be in (0, {MAX_FRAME_BYTES}]")
        to_wire, from_wire = _struct_converters(cls)
        spec = MessageSpec(kind, cls, max_bytes, to_wire, from_wire)
        _REGISTRY[kind] = spec
        _BY_CLASS[cls] = spec
        cls.KIND = kind  # type: ignore[attr-defined]
        return cls

    return register


def spec_of(body: object) -> MessageSpec:
    try:
        return _BY_CLASS[type(body)]
    except KeyError:
        raise TypeError(f"{type(body).__name__} is not a registered wire message") from None


@dataclass(frozen=True)
class Envelope(Generic[T]):
    """A decoded, signature-checked message. `sender` is the base58 peer id that signed it.

    `payload` is the signed payload exactly as received (what the signature covers, fields the
    body ignored included); None for an envelope built in-process and never encoded (the
    simulator without signatures, tests), whose payload is its body's canonical encoding.
    Read it with `signed_payload`. `age_s` is how old its timestamp was by our clock when it was
    decoded (negative: from our future), None for one built in-process: a receiver that must
    agree with others that decode it at other times and on other clocks reads it."""

    kind: str
    sender: str
    sender_bytes: bytes
    ts_ms: int
    body: T
    frame_bytes: int
    payload: bytes | None = None
    age_s: float | None = None


class Codec:
    """Encodes our messages and decodes others'. One per peer; cheap to share."""

    def __init__(
        self,
        identity: Identity | None,
        *,
        max_age_s: float = 300.0,
        max_future_s: float = 30.0,
    ) -> None:
        self.identity = identity
        self.max_age_s = max_age_s
        self.max_future_s = max_future_s
        self._checker = SignatureChecker()

    def encode(self, body: object, now_s: float) -> bytes:
        if self.identity is None:
            raise RuntimeError("this codec has no identity and cannot sign")
        spec = spec_of(body)
        payload = _payload(spec, self.identity.peer_id_bytes, int(now_s * 1000), body)
        frame = payload + self.identity.sign(DOMAIN + payload)
        if len(frame) > spec.max_bytes:
            raise ValueError(f"{spec.kind} message of {len(frame)} bytes exceeds {spec.max_bytes}")
        return frame

    def precheck(self, frame: bytes) -> tuple[str, str]:
        """(kind, sender) of a frame whose signature is good, without decoding its body: what
        gossip checks before it forwards a frame or spends a full decode on it (a manifest
        body can take 0.1 s). Raises only MessageRejected."""
        frame, payload, signature = _split(frame)
        version, kind, sender = _peek_header(payload)
        if version != WIRE_VERSION:
            raise MessageRejected("bad_version", f"version {version!r}")
        spec = _REGISTRY.get(kind)
        if spec is None:
            raise MessageRejected("unknown_type", kind[:64])
        if len(frame) > spec.max_bytes:
            raise MessageRejected("oversized", f"{kind} of {len(frame)} bytes > {spec.max_bytes}")
        self._checker.verify(sender, DOMAIN + payload, signature)
        return kind, peer_id_to_str(sender)

    def decode(self, frame: bytes, now_s: float) -> Envelope[Any]:
        """Decode and check one frame; raises only MessageRejected."""
        frame, payload, signature = _split(frame)
        spec, sender, ts_ms, fields = _outer(payload)
        if len(frame) > spec.max_bytes:
            raise MessageRejected("oversized", f"{spec.kind} of {len(frame)} bytes > {spec.max_bytes}")
        self._checker.verify(sender, DOMAIN + payload, signature)
        sender_text = peer_id_to_str(sender)
        if type(ts_ms) is not int:
            raise MessageRejected("garbage", "timestamp is not an integer", sender_text)
        age_s = now_s - ts_ms / 1000.0
        if age_s > self.max_age_s or -age_s > self.max_future_s:
            raise StaleMessage(age_s, sender_text)
        return Envelope(spec.kind, sender_text, sender, ts_ms, _body(spec, fields, sender_text), len(frame),
                        payload, age_s)


def kept_envelope(payload: bytes) -> Envelope[Any]:
    """The envelope of a signed payload this peer decoded (`Codec.decode`) and kept on its own
    disk (`signed_payload`): parsed again without the signature or the timestamp's age, which
    were checked when it arrived. Nothing received from a peer may come through here: the
    caller checks the payload is the one it kept (the trainer compares its submission id).
    Raises MessageRejected if it does not parse."""
    spec, sender, ts_ms, fields = _outer(payload)
    sender_text = peer_id_to_str(sender)
    if type(ts_ms) is not int:
        raise MessageRejected("garbage", "timestamp is not an integer", sender_text)
    return Envelope(spec.kind, sender_text, sender, ts_ms, _body(spec, fields, sender_text),
                    len(payload) + SIGNATURE_BYTES, payload, None)


def _outer(payload: bytes) -> tuple[MessageSpec, bytes, Any, Any]:
    """(spec, sender, ts_ms, fields) of a payload, after the checks of its envelope's shape."""
    outer = _loads(payload)
    if not (isinstance(outer, list) and len(outer) == 5):
        raise MessageRejected("garbage", "envelope is not a 5-element array")
    version, kind, sender, ts_ms, fields = outer
    if version != WIRE_VERSION or type(version) is not int:
        raise MessageRejected("bad_version", f"version {version!r}")
    if type(kind) is not str:
        raise MessageRejected("garbage", "kind is not text")
    spec = _REGISTRY.get(kind)
    if spec is None:
        raise MessageRejected("unknown_type", kind[:64])
    if type(sender) is not bytes:
        raise MessageRejected("bad_sender", "sender is not bytes")
    return spec, sender, ts_ms, fields


def _body(spec: MessageSpec, fields: Any, sender_text: str) -> Any:
    try:
        return spec.from_wire(fields)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MessageRejected("invalid_field", f"{spec.kind}: {exc}", sender_text) from exc


def signed_payload(envelope: Envelope[Any]) -> bytes:
    """The payload `envelope`'s sender signed: as received, or for an envelope built in-process
    (`payload` None: every declared field, nothing ignored) the canonical encoding of its body."""
    if envelope.payload is not None:
        return envelope.payload
    return _payload(spec_of(envelope.body), envelope.sender_bytes, envelope.ts_ms, envelope.body)


def _payload(spec: MessageSpec, sender_bytes: bytes, ts_ms: int, body: object) -> bytes:
    return cbor2.dumps([WIRE_VERSION, spec.kind, sender_bytes, ts_ms, spec.to_wire(body)], canonical=True)


def _split(frame: bytes) -> tuple[bytes, bytes, bytes]:
    """(frame, payload, signature), after the checks every frame passes first."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise MessageRejected("garbage", "frame is not bytes")
    frame = bytes(frame)
    if len(frame) > MAX_FRAME_BYTES:
        raise MessageRejected("oversized", f"{len(frame)} bytes")
    if len(frame) <= SIGNATURE_BYTES:
        raise MessageRejected("unsigned", "frame too short to carry a signature")
    return frame, frame[:-SIGNATURE_BYTES], frame[-SIGNATURE_BYTES:]


def _peek_header(payload: bytes) -> tuple[int, str, bytes]:
    """The version, kind and sender of a canonical envelope, read from its first bytes only."""

    def item(offset: int) -> tuple[int, int, int]:  # (major type, argument, offset after the head)
        if offset >= len(payload):
            raise MessageRejected("garbage", "envelope ends inside its header")
        head = payload[offset]
        major, info = head >> 5, head & 0x1F
        if info < 24:
            return major, info, offset + 1
        size = {24: 1, 25: 2, 26: 4, 27: 8}.get(info)
        if size is None or offset + 1 + size > len(payload):
            raise MessageRejected("garbage", "not a canonical envelope header")
        return major, int.from_bytes(payload[offset + 1:offset + 1 + size], "big"), offset + 1 + size

    major, count, at = item(0)
    if (major, count) != (4, 5):
        raise MessageRejected("garbage", "envelope is not a 5-element array")
    major, version, at = item(at)
    if major != 0:
        raise MessageRejected("bad_version", "version is not an unsigned integer")
    major, length, at = item(at)
    if major != 3 or at + length > len(payload) or length > 256:
        raise MessageRejected("garbage", "kind is not short text")
    try:
        kind = payload[at:at + length].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MessageRejected("garbage", "kind is not UTF-8") from exc
    major, length, at = item(at + length)
    if major != 2 or at + length > len(payload) or length > 256:
        raise MessageRejected("bad_sender", "sender is not a short byte string")
    return version, kind, payload[at:at + length]


def _refuse_tag(decoder: object, tag: object) -> object:
    raise ValueError("CBOR tags are not allowed")


def _loads(payload: bytes) -> Any:
    try:
        return cbor2.loads(payload, tag_hook=_refuse_tag)
    except Exception as exc:  # cbor2 raises many types on hostile input; all mean garbage
        raise MessageRejected("garbage", f"undecodable CBOR ({type(exc).__name__})") from exc


# -- field converters ---------------------------------------------------------------------


def _struct_converters(cls: type) -> tuple[Callable[[Any], list], Callable[[Any], Any]]:
    """Positional converters of a message or nested struct, under the evolution rule (see the
    module docstring): trailing fields with defaults may be missing, extra trailing values are
    ignored."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    if any(f.kw_only for f in fields):
        raise TypeError(f"{cls.__name__}: keyword-only fields have no position on the wire")
    names = [f.name for f in fields]
    pairs = [_converters(hints[f.name]) for f in fields]
    encoders = [p[0] for p in pairs]
    decoders = [p[1] for p in pairs]
    required = sum(1 for f in fields if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING)
    for f, (enc, dec) in zip(fields, pairs):
        _check_default(cls, f, enc, dec)

    def to_wire(obj: Any) -> list:
        return [enc(getattr(obj, name)) for name, enc in zip(names, encoders)]

    def from_wire(raw: Any) -> Any:
        if type(raw) is not list:
            raise TypeError(f"{cls.__name__} is not an array")
        if len(raw) < required:
            raise TypeError(f"{cls.__name__} wants at least {required} fields, got {len(raw)}")
        # zip stops at the shorter: missing trailing fields take their defaults, extra ones are ignored
        return cls(*[dec(value) for dec, value in zip(decoders, raw)])

    return to_wire, from_wire


def _check_default(cls: type, f: dataclasses.Field, enc: Callable[[Any], Any], dec: Callable[[Any], Any]) -> None:
    """A default stands for what an older sender did not send, so it must be a value a sender could
    have sent: it survives encoding, CBOR and decoding unchanged (else a new peer would read an old
    peer's message as something no peer can say)."""
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return
    try:
        again = dec(cbor2.loads(cbor2.dumps(enc(default), canonical=True)))
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{cls.__name__}.{f.name}: its default {default!r} is not a value the wire can carry: {exc}") from exc
    if again != default:
        raise TypeError(f"{cls.__name__}.{f.name}: its default {default!r} decodes as {again!r}")


def _identity(value: Any) -> Any:
    return value


def _converters(hint: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is bool:
        return _identity, _expect(bool)
    if hint is int:
        return _identity, _decode_int
    if hint is float:
        return float, _decode_float
    if hint is str:
        return _identity, _expect(str)
    if hint is bytes:
        return bytes, _expect(bytes)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner_enc, inner_dec = _converters(next(a for a in args if a is not type(None)))
        return (lambda v: None if v is None else inner_enc(v)), (
            lambda v: None if v is None else inner_dec(v)
        )
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item_enc, item_dec = _converters(args[0])

        def dec_var(value: Any) -> tuple:
            if type(value) is not list:
                raise TypeError("expected an array")
            return tuple(item_dec(v) for v in value)

        return (lambda v: [item_enc(x) for x in v]), dec_var
    if origin is tuple:
        pairs = [_converters(a) for a in args]

        def dec_fixed(value: Any) -> tuple:
            if type(value) is not list or len(value) != len(pairs):
                raise TypeError(f"expected an array of {len(pairs)}")
            return tuple(p[1](v) for p, v in zip(pairs, value))

        return (lambda v: [p[0](x) for p, x in zip(pairs, v)]), dec_fixed
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _struct_converters(hint)
    raise TypeError(f"unsupported wire field type {hint!r}")


def _expect(kind: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if type(value) is not kind:
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return check


def _decode_int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"expected int, got {type(value).__name__}")
    if not _INT_MIN <= value <= _INT_MAX:
        raise ValueError("integer outside the 64-bit range")
    return value


def _decode_float(value: Any) -> float:
    if type(value) not in (float, int):
        raise TypeError(f"expected float, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError("float is not finite")
    return result

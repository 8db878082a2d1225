"""Wire messages of verification: rollout submissions, validator claims and verdicts.

Owns: the typed frozen bodies (registered with the one codec, `p2pnet.wire`), their
invariants (checked in `__post_init__`, so a decoded body is always well-formed), the
packing of token arrays, the gossip topic names, and the submission id.

Flow: a worker publishes a signed `Submission` on `SUBMISSIONS_TOPIC` (the worker is the
envelope's sender). Each validator draws its ticket for it (verify.assign); the selected
ones publish a `Claim` on `CLAIMS_TOPIC`, the lowest claim checks, and it publishes a signed
`Verdict` on `VERDICTS_TOPIC`. The trainer's intake listens to submissions and verdicts.
A trainer that restarted sends `Recall` to workers and validators; they answer directly, a
worker with `Recalled` (its submission frames as first sent), a validator with its claims and
verdicts (`verify.recall`).

Submission id: blake3 of the *signed payload* of the submission (wire version, kind, sender,
timestamp and fields) exactly as it was received (`p2pnet.wire.signed_payload`), never a
re-encoding of the decoded body: a peer one version apart decodes the body with fields ignored
or defaulted (the codec's evolution rule), and a re-encoding would give workers, validators and
the trainer different ids for one submission (a verdict's ticket signs the id). The payload is
what the signature binds, so this is as strong as hashing the frame and cannot be changed by
signature malleability.

Must not: run a model, check proofs, or decide anything beyond a body's own shape.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import blake3

from p2pnet.identity import peer_id_from_str
from p2pnet.wire import SIGNATURE_BYTES, Envelope, message, signed_payload

SUBMISSIONS_TOPIC = "verify/v1/submissions"
CLAIMS_TOPIC = "verify/v1/claims"
VERDICTS_TOPIC = "verify/v1/verdicts"

SUBMISSION_MAX_BYTES = 2 * 1024 * 1024
SUBMISSION_ID_BYTES = 32
TICKET_BYTES = 64
MAX_PROOF_BYTES = 258  # m + 128 coefficients, u16 each
CHUNK_TOKENS = 32
MAX_REASONS = 32
MAX_REASON_CHARS = 128
MAX_ROLLOUTS = 4096
STOP_REASONS = ("eos", "length")
STACK_DTYPES = ("fp32", "bf16", "fp16", "unknown")
_STACK_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.-")
_U32 = struct.Struct("<I")
_F32 = struct.Struct("<f")


# -- packing ------------------------------------------------------------------------------


def pack_u32(values: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian; ValueError for ids outside [0, 2**32)."""
    try:
        return struct.pack(f"<{len(values)}I", *values)
    except struct.error as exc:
        raise ValueError(f"token ids must lie in [0, 2**32): {exc}") from None


def unpack_u32(data: bytes) -> tuple[int, ...]:
    if len(data) % 4:
        raise ValueError("packed u32 array length is not a multiple of 4")
    return struct.unpack(f"<{len(data) // 4}I", data)


def pack_f32(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def unpack_f32(data: bytes) -> tuple[float, ...]:
    if len(data) % 4:
        raise ValueError("packed f32 array length is not a multiple of 4")
    return struct.unpack(f"<{len(data) // 4}f", data)


# -- bodies -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RolloutRecord:
    """One generated sequence. Invariants: a non-empty prompt and output; as many log-probs
    (finite, <= 0) as output tokens; one proof per `CHUNK_TOKENS` output tokens, each
    2 + 2k bytes with 1 <= k <= 128; `stop_reason` is "eos" or "length"."""

    prompt_ids: bytes
    output_ids: bytes
    logprobs: bytes
    proofs: tuple[bytes, ...]
    stop_reason: str
    row: int

    def __post_init__(self) -> None:
        for name in ("prompt_ids", "output_ids", "logprobs"):
            if len(getattr(self, name)) % 4:
                raise ValueError(f"{name} length is not a multiple of 4")
        if not self.prompt_ids or not self.output_ids:
            raise ValueError("prompt and output must be non-empty")
        if len(self.logprobs) != len(self.output_ids):
            raise ValueError("one log-prob per output token")
        n_out = len(self.output_ids) // 4
        if len(self.proofs) != -(-n_out // CHUNK_TOKENS):
            raise ValueError(f"{len(self.proofs)} proofs for {n_out} output tokens")
        if any(not 4 <= len(p) <= MAX_PROOF_BYTES or len(p) % 2 for p in self.proofs):
            raise ValueError("a proof must be 2 + 2k bytes, 1 <= k <= 128")
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason must be one of {STOP_REASONS}")
        if self.row < 0:
            raise ValueError("row must be >= 0")
        if any(not (math.isfinite(v) and v <= 0.0) for v in unpack_f32(self.logprobs)):
            raise ValueError("log-probs must be finite and <= 0")

    @property
    def prompt(self) -> tuple[int, ...]:
        return unpack_u32(self.prompt_ids)

    @property
    def output(self) -> tuple[int, ...]:
        return unpack_u32(self.output_ids)

    @property
    def logprob_values(self) -> tuple[float, ...]:
        return unpack_f32(self.logprobs)


@dataclass(frozen=True, slots=True)
class Stack:
    """What computed a rollout's hidden states: model dtype, inference backend ("torch" for
    trainer.rollout, "vllm"), and device type ("cpu", "cuda"). Validators pick the calibration
    table of (worker stack, their own stack) by ``key``. "unknown" everywhere: not declared
    (no calibration table matches it)."""

    dtype: str
    backend: str
    device: str

    def __post_init__(self) -> None:
        if self.dtype not in STACK_DTYPES:
            raise ValueError(f"stack dtype must be one of {STACK_DTYPES}")
        for name in ("backend", "device"):
            value = getattr(self, name)
            if not 0 < len(value) <= 32 or not set(value) <= _STACK_CHARS:
                raise ValueError(f"stack {name} must be 1..32 characters of [a-z0-9_.-]")

    @property
    def key(self) -> str:
        return f"{self.dtype}/{self.backend}/{self.device}"


UNDECLARED_STACK = Stack("unknown", "unknown", "unknown")


def stack_of(model: Any, backend: str) -> Stack:
    """The stack of a torch model (duck-typed: verify.messages does not import torch)."""
    param = next(iter(model.parameters()))
    dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(param.dtype), "unknown")
    return Stack(dtype, backend, str(param.device.type))


@message("verify/submission", max_bytes=SUBMISSION_MAX_BYTES)
@dataclass(frozen=True, slots=True)
class Submission:
    """A worker's rollouts for one step, generated by policy `model_version`.

    `seed` is the u64 sampling seed the worker used (validators recompute it from
    `task_seed`, the worker and `step`); `task_seed` keys the prompt assignment. Rollout i
    has row i; rows i*G .. i*G+G-1 answer prompt i (G = group_size). `nonce` (16-32 bytes)
    makes every submission unique; a reused nonce is a replay. `stack` declares what
    computed the hidden states (signed with the rest; validators calibrate per stack pair).
    """

    model: str
    model_version: int
    step: int
    seed: int
    task_seed: int
    prompts_per_submission: int
    group_size: int
    temperature: float
    max_new_tokens: int
    rollouts: tuple[RolloutRecord, ...]
    nonce: bytes
    stack: Stack = UNDECLARED_STACK

    def __post_init__(self) -> None:
        if not 0 < len(self.model) <= 256:
            raise ValueError("model name must have 1..256 characters")
        for name in ("model_version", "step", "seed", "task_seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.prompts_per_submission < 1 or self.group_size < 1:
            raise ValueError("prompts_per_submission and group_size must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError("temperature must be finite and > 0")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if len(self.rollouts) != self.prompts_per_submission * self.group_size:
            raise ValueError("rollouts must be prompts_per_submission * group_size")
        if len(self.rollouts) > MAX_ROLLOUTS:
            raise ValueError(f"at most {MAX_ROLLOUTS} rollouts")
        for i, rollout in enumerate(self.rollouts):
            if rollout.row != i:
                raise ValueError(f"rollout {i} carries row {rollout.row}")
            if len(rollout.output_ids) // 4 > self.max_new_tokens:
                raise ValueError(f"rollout {i} is longer than max_new_tokens")
        if not 16 <= len(self.nonce) <= 32:
            raise ValueError("nonce must have 16..32 bytes")


@message("verify/claim", max_bytes=1024)
@dataclass(frozen=True, slots=True)
class Claim:
    """A validator was drawn for `submission_id`: `ticket` is its signature over the id
    (verify.assign); the lowest ticket value among claims checks."""

    submission_id: bytes
    ticket: bytes

    def __post_init__(self) -> None:
        if len(self.submission_id) != SUBMISSION_ID_BYTES:
            raise ValueError("submission_id must have 32 bytes")
        if len(self.ticket) != TICKET_BYTES:
            raise ValueError("ticket must have 64 bytes")


@message("verify/verdict", max_bytes=8192)
@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of checking one submission, signed by the validator (the sender).

    `validator_ticket` proves the sender was drawn for this submission (verify.assign).
    `reasons` are stable codes, empty iff accepted; `checked_rollouts` > 0 says how many
    rollouts were recomputed.
    """

    submission_id: bytes
    worker: str
    model_version: int
    step: int
    accepted: bool
    reasons: tuple[str, ...]
    checked_rollouts: int
    validator_ticket: bytes

    def __post_init__(self) -> None:
        if len(self.submission_id) != SUBMISSION_ID_BYTES:
            raise ValueError("submission_id must have 32 bytes")
        if len(self.validator_ticket) != TICKET_BYTES:
            raise ValueError("validator_ticket must have 64 bytes")
        peer_id_from_str(self.worker)  # ValueError unless an Ed25519 peer id
        if self.model_version < 0 or self.step < 0:
            raise ValueError("model_version and step must be >= 0")
        if self.accepted == bool(self.reasons):
            raise ValueError("reasons must be empty iff accepted")
        if len(self.reasons) > MAX_REASONS or any(not 0 < len(r) <= MAX_REASON_CHARS for r in self.reasons):
            raise ValueError(f"at most {MAX_REASONS} reasons of 1..{MAX_REASON_CHARS} characters")
        if self.checked_rollouts < 1:
            raise ValueError("checked_rollouts must be >= 1")


@message("verify/recall", max_bytes=256)
@dataclass(frozen=True, slots=True)
class Recall:
    """A restarted trainer asks, directly, for what it may have missed while it was down: the
    worker's own submissions and the validator's claims and verdicts of steps >= `since_step`
    (`verify.recall`). Workers and validators answer only their trusted publishers."""

    since_step: int

    def __post_init__(self) -> None:
        if self.since_step < 0:
            raise ValueError("since_step must be >= 0")


@message("verify/recalled", max_bytes=SUBMISSION_MAX_BYTES + 1024)
@dataclass(frozen=True, slots=True)
class Recalled:
    """A worker's answer to a `Recall`: one of its submissions, the frame exactly as it first
    published it (signed then: its id is the one validators' verdicts name), sent directly."""

    frame: bytes

    def __post_init__(self) -> None:
        if not SIGNATURE_BYTES < len(self.frame) <= SUBMISSION_MAX_BYTES:
            raise ValueError(f"a submission frame of {len(self.frame)} bytes")


# -- ids and helpers ----------------------------------------------------------------------

_ID_DOMAIN = b"p2pnet/verify/submission-id/v1\x00"


def submission_id(envelope: Envelope[Any]) -> bytes:
    """blake3 of the signed payload as received (see the module docstring)."""
    return blake3.blake3(_ID_DOMAIN + signed_payload(envelope)).digest()


def submission_id_of(frame: bytes) -> bytes:
    """The id of a submission frame, as every receiver will compute it: what a worker that
    encoded the frame itself can compute before verdicts arrive."""
    return blake3.blake3(_ID_DOMAIN + bytes(frame[:-SIGNATURE_BYTES])).digest()


def rollout_record(*, prompt_ids: Sequence[int], output_ids: Sequence[int], logprobs: Sequence[float],
                   proofs: Sequence[bytes], stop_reason: str, row: int) -> RolloutRecord:
    return RolloutRecord(pack_u32(prompt_ids), pack_u32(output_ids), pack_f32(logprobs),
                         tuple(bytes(p) for p in proofs), stop_reason, row)


def submission_from_batch(batch: Any, *, model: str, prompts_per_submission: int, nonce: bytes,
                          stack: Stack = UNDECLARED_STACK) -> Submission:
    """A Submission from a trainer `RolloutBatch` (duck-typed: verify does not import trainer).

    The batch's `seed` is the network (task) seed; its `sampling_seed` is what it sampled with;
    `stack` is what generated it (`stack_of(model, backend)`).
    """
    rollouts = tuple(
        rollout_record(prompt_ids=r.prompt_ids, output_ids=r.output_ids, logprobs=r.logprobs,
                       proofs=r.proofs, stop_reason=r.stop_reason, row=r.row)
        for r in batch.rollouts
    )
    return Submission(model=model, model_version=batch.model_version, step=batch.step,
                      seed=batch.sampling_seed, task_seed=batch.seed,
                      prompts_per_submission=prompts_per_submission, group_size=batch.group_size,
                      temperature=float(batch.temperature), max_new_tokens=batch.max_new_tokens,
                      rollouts=rollouts, nonce=nonce, stack=stack)

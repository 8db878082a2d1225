"""DiLoCo's arithmetic: pseudo-gradients, int8 quantization with per-block scales, contribution
checks and the outer Nesterov step.

Theory of operation. Every trainer peer starts a round from the same global weights `g`. It
takes H inner AdamW steps on its own data and ends at local weights `w`; its pseudo-gradient is
`g - w` (what the inner steps moved, sign flipped so that it points like a gradient). The peers
average their pseudo-gradients (`trainer.allreduce`) and every peer applies the same outer step
to `g`: SGD with Nesterov momentum, DiLoCo's defaults lr 0.7 and momentum 0.9, exactly as
`torch.optim.SGD(nesterov=True)` would:

    m <- momentum * m + delta;   g <- g - lr * (delta + momentum * m)

A mean that is finite can still make that step overflow (a reduced mean of 2.5e38, finite in
float32 and in int8, and Nesterov's delta + momentum * m doubles it): a step that would leave a
weight or a momentum value not finite raises (`OuterStepNotFinite`) and changes nothing, and the
role discards the round (`trainer.diloco_role`), alike at every member that got the same mean.

Vectors travel quantized: each block of `block` values is sent as int8 `round(x / scale)` with
`scale = max|x| / 127` of that block as float32, so a value's error is at most half a scale
(`max|x_block| / 254`) and the bytes are `n + 4 * ceil(n / block)`, about 4x fewer than fp32.

Before a contribution is reduced it is checked (`screen`, `check_contribution`): the right
length, only finite values, and a norm at most `max_norm_ratio` times the median norm of ALL the
shard's well-formed contributions, this one's among them (`norm_limit`). What fails is named by
`Rejection`; the shell penalises the sender.

Why the median of all, not of the others. The screen exists to keep one outsized (or non-finite)
contribution out of the mean: averaged in, it would move every member's weights by as much as it
likes. Judged against the others alone, each honest contribution's reference leaves itself out
and takes the attacker's in, so h - 1 zero contributions beside h honest ones (a minority: one
beside two, two beside three) made the lower median of every honest one's others a zero, and
every honest contribution was rejected. Taken over all of them, the lower median is the
((n+1)//2)-th smallest norm of n: while fewer than half of the n come from one party, at least
one of the other party's norms is at or below it and one at or above it, so it lies between the
smallest and the largest of the other party's norms. Hence, whatever a minority sends (zeros,
faint noise, huge values or a mix): an honest contribution is rejected only if it is more than
`max_norm_ratio` times the smallest honest norm (the honest ones disagree that much among
themselves), and a contribution taken has a norm of at most `max_norm_ratio` times the largest
honest one (or times 1e-12, the median's floor, if that is larger). The n are the well-formed
contributions: one of the wrong length or not finite is rejected and left out of the median, so
sending such ones moves nothing. Exactly half is the tie the lower median breaks: half the
contributions zero (or tiny) can get every honest one rejected, half of them huge still cannot
get one above that limit taken. More than half set the median and can do either: nothing here
stops a majority, and in an open group identities cost nothing (closing the group does:
`[diloco] trainers`). With fewer than three contributions there is no majority to judge by and
norms are not checked (one huge contribution beside one other is taken).

Whose screen this is. All of the above is what a shard's owner decides when it is honest: the
screen runs only there (`trainer.allreduce`), and every member applies the reduced value the
shard's owner sends. A member owns a shard every round (shard i is members[i]'s), so one identity
admitted to a round sends whatever mean and contributors it likes for its own shard, screened by
no one. Others' shards it cannot set: a member takes a shard's reduced value only from the member
it holds to reduce it (the owner, or the successor its own view of the dead passes the shard to)
or from one before that in the shard's chain (dead for it, yet it reduced: a link down one way),
never pieces of two senders joined, and drops any other member's
(`trainer.allreduce_gather`, which also says why the owner's mean is not checked by norm at
the receivers). No norm screen bounds what an owner sends; closing the group does.

Rejected, not clipped. Clipping an outsized contribution to the limit (robust aggregation's
usual norm clipping) would give its sender the weight of one sent just under the limit, which the
screen takes anyway, so it would take nothing from an attacker that rejecting takes; and a
penalty would then be for a contribution averaged in all the same, while without one a peer
could send outsized values for ever. Rejected, it has no weight in the mean and costs its sender
a peer-table penalty: one that keeps sending them is banned. A minority cannot turn that against
an honest peer (above: unless the honest contributions themselves differ more than
`max_norm_ratio`-fold, which the penalty then says).

Not screened from below. A check for small norms would catch zeros and faint noise alike (unlike
a check for zeros), but an attacker then sends random values of an honest norm, which costs the
same (no compute, the same upload), passes, and moves the mean where a zero only shrinks it: it
would stop nothing and make the cheapest attack a worse one. An honest peer's contribution is
never exactly zero either, so it would catch no mistake. What a contribution within the limit
does to the mean (dilutes it, or adds up to `max_norm_ratio` times the median in any direction,
divided by the number averaged) no screen by norm can tell from training: only the group's
membership bounds it.

The screen is part of the protocol: one peer reduces a shard and every member applies the mean it
sends, so its result depends only on the contributions, not on the order they came in.

This module must not do I/O or hold any clock or global random state: it is handed tensors
and returns tensors.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Collection, Mapping

import torch

INT8_MAX = 127
DEFAULT_BLOCK = 4096


class Encoding(enum.Enum):
    INT8 = "int8"
    FP32 = "fp32"


@dataclass(frozen=True)
class Packed:
    """A quantized vector: int8 `values` (n bytes) and one float32 scale per block (fp32:
    `values` holds the raw float32 bytes and `scales` is empty)."""

    encoding: Encoding
    length: int
    block: int
    values: bytes
    scales: bytes

    @property
    def nbytes(self) -> int:
        return len(self.values) + len(self.scales)


def pack(vector: torch.Tensor, encoding: Encoding, block: int = DEFAULT_BLOCK) -> Packed:
    """`vector` (1-D float32) in `encoding`. A finite vector decodes (`unpack`) finite, in int8
    too: a block's scale is kept below the one whose 127 x would overflow float32."""
    flat = vector.detach().reshape(-1).to(torch.float32).contiguous()
    n = flat.numel()
    if encoding is Encoding.FP32:
        return Packed(encoding, n, block, flat.numpy().tobytes(), b"")
    if block < 1:
        raise ValueError("block must be >= 1")
    blocks = math.ceil(n / block) if n else 0
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[:n] = flat
    grid = padded.view(blocks, block)
    scales = grid.abs().amax(dim=1) / INT8_MAX
    # a block whose largest value is near float32's largest: 127 x scale can round past it, and
    # decode to inf. Such a scale steps down an ulp at a time until it does not (a step or two; the
    # values at the top clamp to 127, off by a few ulps of the scale, within half of it)
    while bool((over := torch.isinf(scales * INT8_MAX)).any()):
        scales = torch.where(over, torch.nextafter(scales, torch.zeros_like(scales)), scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(grid / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Packed(encoding, n, block, q.reshape(-1)[:n].numpy().tobytes(), scales.numpy().tobytes())


def unpack(packed: Packed) -> torch.Tensor:
    """The float32 vector a `Packed` stands for; ValueError when its sizes do not add up."""
    n = packed.length
    if packed.encoding is Encoding.FP32:
        if len(packed.values) != 4 * n or packed.scales:
            raise ValueError(f"fp32 vector of {n} values needs {4 * n} bytes, got {len(packed.values)}")
        return torch.frombuffer(bytearray(packed.values), dtype=torch.float32).clone()
    blocks = math.ceil(n / packed.block) if n else 0
    if len(packed.values) != n or len(packed.scales) != 4 * blocks:
        raise ValueError(f"int8 vector of {n} values in blocks of {packed.block} needs {n} + {4 * blocks} bytes, "
                         f"got {len(packed.values)} + {len(packed.scales)}")
    if n == 0:
        return torch.zeros(0, dtype=torch.float32)
    q = torch.frombuffer(bytearray(packed.values), dtype=torch.int8).to(torch.float32)
    scales = torch.frombuffer(bytearray(packed.scales), dtype=torch.float32)
    per_value = scales.repeat_interleave(min(packed.block, n))[:n]  # the block is the sender's: n values at most
    return q * per_value


def packed_bytes(length: int, encoding: Encoding, block: int = DEFAULT_BLOCK) -> int:
    """Bytes `pack` makes of a vector of `length` values (without message framing)."""
    if encoding is Encoding.FP32:
        return 4 * length
    return length + 4 * math.ceil(length / block)


def max_quantization_error(vector: torch.Tensor, block: int = DEFAULT_BLOCK) -> float:
    """The bound on |unpack(pack(v)) - v| per value: half the largest block scale."""
    flat = vector.reshape(-1).to(torch.float32)
    n = flat.numel()
    if n == 0:
        return 0.0
    padded = torch.zeros(math.ceil(n / block) * block)
    padded[:n] = flat.abs()
    return float(padded.view(-1, block).amax(dim=1).max()) / INT8_MAX / 2


# -- weights as one flat vector --------------------------------------------------------------


def flatten(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Every floating tensor of `state`, in its key order, as one float32 vector."""
    parts = [t.detach().reshape(-1).to(torch.float32) for t in state.values() if t.is_floating_point()]
    return torch.cat(parts) if parts else torch.zeros(0)


def unflatten_into(vector: torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `vector` back into the floating tensors of `state` (in place, in key order)."""
    offset = 0
    with torch.no_grad():
        for t in state.values():
            if not t.is_floating_point():
                continue
            n = t.numel()
            t.copy_(vector[offset:offset + n].view_as(t).to(t.dtype))
            offset += n
    if offset != vector.numel():
        raise ValueError(f"vector of {vector.numel()} values for a state of {offset}")


def digest(vector: torch.Tensor) -> bytes:
    """A 16-byte blake3 digest of a float32 vector: peers compare their global weights by it."""
    import blake3

    return blake3.blake3(vector.to(torch.float32).contiguous().numpy().tobytes()).digest()[:16]


# -- contributions ----------------------------------------------------------------------------


class Rejection(enum.Enum):
    WRONG_SHAPE = "wrong_shape"
    NOT_FINITE = "not_finite"
    NORM_OUTLIER = "norm_outlier"


MIN_JUDGED = 3  # well-formed contributions a shard needs before their norms are judged


def norm_limit(norms: Collection[float], max_norm_ratio: float = 10.0) -> float:
    """The largest norm a contribution to a shard may have, given `norms`: the norms of ALL the
    shard's well-formed (right length, finite) contributions, the one judged among them. It is
    `max_norm_ratio` x their lower median (the ((n+1)//2)-th smallest of n: a minority of them,
    whatever it sends, cannot move it outside the range of the others' norms; see the module
    docstring), infinite with fewer than `MIN_JUDGED` of them (no majority to judge by). A zero
    median counts as 1e-12."""
    if len(norms) < MIN_JUDGED:
        return math.inf
    lower_median = sorted(norms)[(len(norms) - 1) // 2]
    return max_norm_ratio * max(lower_median, 1e-12)


def check_contribution(part: torch.Tensor, expected_length: int, limit: float = math.inf) -> Rejection | None:
    """Why `part` must not be reduced, or None: the wrong shape, a value that is not finite, or a
    norm above `limit` (`norm_limit` of the shard's contributions). A small norm is not rejected:
    it only dilutes the mean (the module docstring says why a check from below would stop
    nothing)."""
    if part.dim() != 1 or part.numel() != expected_length:
        return Rejection.WRONG_SHAPE
    if not bool(torch.isfinite(part).all()):
        return Rejection.NOT_FINITE
    if _norm(part) > limit:
        return Rejection.NORM_OUTLIER
    return None


def screen(parts: Mapping[str, torch.Tensor], expected_length: int,
           max_norm_ratio: float = 10.0) -> tuple[dict[str, torch.Tensor], dict[str, Rejection]]:
    """Split a shard's contributions into (accepted, rejected with why), each judged against the
    median norm of all the well-formed ones (`norm_limit`). Both are keyed in peer order: what
    is decided does not depend on the order `parts` came in."""
    norms = {peer: _norm(p) for peer, p in parts.items()
             if p.dim() == 1 and p.numel() == expected_length and bool(torch.isfinite(p).all())}
    limit = norm_limit(list(norms.values()), max_norm_ratio)
    accepted, rejected = {}, {}
    for peer in sorted(parts):
        why = check_contribution(parts[peer], expected_length, limit)
        if why is None:
            accepted[peer] = parts[peer]
        else:
            rejected[peer] = why
    return accepted, rejected


def _norm(part: torch.Tensor) -> float:
    return float(part.norm())


# -- the outer optimizer -------------------------------------------------------------------


@dataclass(frozen=True)
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ValueError("outer lr must be > 0 and momentum in [0, 1)")


class OuterStepNotFinite(ValueError):
    """The outer step would leave a weight or a momentum value that is not finite (`where`: a
    mask over the weights): the mean it was handed is at fault, finite as each of its values may
    be (a reduced mean of 2.5e38 is finite in float32 and in int8, and Nesterov's
    `delta + momentum * m` doubles it past float32's largest). Raised before anything changes."""

    def __init__(self, where: torch.Tensor) -> None:
        super().__init__(f"the outer step leaves {int(where.sum())} values not finite")
        self.where = where


class OuterOptimizer:
    """SGD with Nesterov momentum on the flat global weights; `momentum_buffer` is its state."""

    def __init__(self, config: OuterConfig, length: int, momentum_buffer: torch.Tensor | None = None) -> None:
        self.config = config
        self.momentum_buffer = torch.zeros(length) if momentum_buffer is None else momentum_buffer.clone()
        if self.momentum_buffer.numel() != length:
            raise ValueError(f"momentum of {self.momentum_buffer.numel()} values for {length} weights")

    def step(self, global_weights: torch.Tensor, mean_pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """The next global weights (a new tensor; the momentum buffer is updated in place), or
        `OuterStepNotFinite` when a new weight or momentum value would not be finite: then the
        momentum buffer is left as it was. Elementwise float32, so whether it raises depends only
        on the weights, the momentum and the mean: members that apply one mean from one state
        decide alike."""
        mu = self.config.momentum
        momentum = self.momentum_buffer * mu + mean_pseudo_gradient
        weights = global_weights - self.config.lr * (mean_pseudo_gradient + mu * momentum)
        where = ~(torch.isfinite(weights) & torch.isfinite(momentum))
        if bool(where.any()):
            raise OuterStepNotFinite(where)
        self.momentum_buffer.copy_(momentum)
        return weights


def pseudo_gradient(global_weights: torch.Tensor, local_weights: torch.Tensor) -> torch.Tensor:
    return global_weights - local_weights

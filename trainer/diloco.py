"""DiLoCo's arithmetic: pseudo-gradients, int8 quantization with per-block scales, contribution
checks and the outer Nesterov step.

Theory of operation. Every trainer peer starts a round from the same global weights `g`. It
takes H inner AdamW steps on its own data and ends at local weights `w`; its pseudo-gradient is
`g - w` (what the inner steps moved, sign flipped so that it points like a gradient). The peers
average their pseudo-gradients (`trainer.allreduce`) and every peer applies the same outer step
to `g`: SGD with Nesterov momentum, DiLoCo's defaults lr 0.7 and momentum 0.9, exactly as
`torch.optim.SGD(nesterov=True)` would:

    m <- momentum * m + delta;   g <- g - lr * (delta + momentum * m)

Vectors travel quantized: each block of `block` values is sent as int8 `round(x / scale)` with
`scale = max|x| / 127` of that block as float32, so a value's error is at most half a scale
(`max|x_block| / 254`) and the bytes are `n + 4 * ceil(n / block)`, about 4x fewer than fp32.

Before a contribution is reduced it is checked (`check_contribution`): the right length, only
finite values, and a norm within `max_norm_ratio` of the median of the others. What fails is
named by `Rejection`; the shell penalises the sender.

This module must not do I/O or hold any clock or global random state: it is handed tensors
and returns tensors.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Mapping

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
    """`vector` (1-D float32) in `encoding`."""
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


def check_contribution(part: torch.Tensor, expected_length: int, other_norms: list[float],
                       max_norm_ratio: float = 10.0) -> Rejection | None:
    """Why `part` must not be reduced, or None. `other_norms` are the norms of the other
    contributions to the same shard: a norm above `max_norm_ratio` x their lower median is
    rejected (the lower median, so that one huge contribution among two others cannot make an
    honest one look small). A small norm is not rejected: it only dilutes the mean. With fewer
    than two others there is nothing to judge by and the norm is not checked."""
    if part.dim() != 1 or part.numel() != expected_length:
        return Rejection.WRONG_SHAPE
    if not bool(torch.isfinite(part).all()):
        return Rejection.NOT_FINITE
    if len(other_norms) >= 2:
        lower_median = sorted(other_norms)[(len(other_norms) - 1) // 2]
        if float(part.norm()) > max_norm_ratio * max(lower_median, 1e-12):
            return Rejection.NORM_OUTLIER
    return None


def screen(parts: Mapping[str, torch.Tensor], expected_length: int,
           max_norm_ratio: float = 10.0) -> tuple[dict[str, torch.Tensor], dict[str, Rejection]]:
    """Split contributions into (accepted, rejected with why); each is judged against the others."""
    norms = {peer: float(p.norm()) if p.numel() == expected_length and bool(torch.isfinite(p).all()) else math.nan
             for peer, p in parts.items()}
    accepted, rejected = {}, {}
    for peer, part in parts.items():
        others = [v for q, v in norms.items() if q != peer and not math.isnan(v)]
        why = check_contribution(part, expected_length, others, max_norm_ratio)
        if why is None:
            accepted[peer] = part
        else:
            rejected[peer] = why
    return accepted, rejected


# -- the outer optimizer -------------------------------------------------------------------


@dataclass(frozen=True)
class OuterConfig:
    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ValueError("outer lr must be > 0 and momentum in [0, 1)")


class OuterOptimizer:
    """SGD with Nesterov momentum on the flat global weights; `momentum_buffer` is its state."""

    def __init__(self, config: OuterConfig, length: int, momentum_buffer: torch.Tensor | None = None) -> None:
        self.config = config
        self.momentum_buffer = torch.zeros(length) if momentum_buffer is None else momentum_buffer.clone()
        if self.momentum_buffer.numel() != length:
            raise ValueError(f"momentum of {self.momentum_buffer.numel()} values for {length} weights")

    def step(self, global_weights: torch.Tensor, mean_pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """The next global weights (a new tensor; the momentum buffer is updated in place)."""
        mu = self.config.momentum
        self.momentum_buffer.mul_(mu).add_(mean_pseudo_gradient)
        update = mean_pseudo_gradient + mu * self.momentum_buffer
        return global_weights - self.config.lr * update


def pseudo_gradient(global_weights: torch.Tensor, local_weights: torch.Tensor) -> torch.Tensor:
    return global_weights - local_weights

"""Seeded sampling that a validator can replay exactly.

Owns: the Gumbel noise a worker must use when it samples token ``position`` of sequence
``row`` under a submission ``seed``; sampling with it (Gumbel-max: argmax(logits / T + g));
log-probabilities of chosen tokens; the replay check a validator runs on recomputed logits;
the termination check (a sequence ends with an EOS that is probable or was the seeded sample,
or at the length limit).

Must not: run a model, read files, or use any global random state. The noise is a pure
function of (seed, row, position, vocab_size), identical on every platform and numpy/torch
version: it is derived from the Philox4x64-10 counter-based generator's *raw* 64-bit words
(a fixed algorithm), keyed by blake3 of (seed, row), with the position in the counter, and
turned into uniforms and Gumbels by our own arithmetic (not numpy's distribution code, whose
streams may change between versions).

Numbering: ``position`` 0 is the first generated token of a sequence; ``row`` is the index of
the sequence in its submission, so the G samples of one prompt all get different noise.

Why Gumbel-max: argmax(logits/T + Gumbel) is an exact sample from softmax(logits/T), and a
validator who recomputes the logits in one prefill can check every token. Prefill logits
differ from decode logits by float noise, so a token is only flagged when its perturbed score
is more than ``margin`` below the best perturbed score (see docs/calibration.md).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np
import torch

from verify.errors import ProofError

__all__ = [
    "DEFAULT_MARGIN",
    "DEFAULT_MIN_EOS_PROB",
    "DEFAULT_SEEDED_EOS_DEFICIT",
    "SamplingReport",
    "Termination",
    "TerminationReport",
    "check_termination",
    "gumbel_noise",
    "replay_check",
    "sample_tokens",
    "token_logprobs",
]

_DOMAIN = b"p2pnet/verify/sampling/gumbel/v1"
_U64 = 1 << 64
# Default tolerance, in units of perturbed score (logits / T + g). Calibrated by
# scripts/calibrate.py on CPU at temperature 1 (the tiny model's run, before docs/calibration.md
# became SmolLM2's): the worst honest deficit measured was 0.37 (fp32 validator against a bf16
# worker; 0.19 for a bf16 sdpa validator; SmolLM2 0.135), a substituted token's deficit had
# median 8.8 and minimum 1.5. 1.0 leaves room for the larger logit noise of real models. Logit
# noise enters divided by T, so honest deficits grow at lower temperatures.
DEFAULT_MARGIN = 1.0
DEFAULT_MIN_EOS_PROB = 1e-4
# An EOS below DEFAULT_MIN_EOS_PROB still ends a sequence legitimately when the replay shows it
# was the seeded sample: its deficit is at most this, above the float noise an honest worker's
# own argmax shows (0.37 worst, above). Without it an honest worker is rejected for every EOS it
# samples at probability p < 1e-4, which happens with probability up to p per token. The
# margin's slack (0.5 to 1.0) does not count: at a position where EOS has probability p, it
# lies within d of the best score with probability p e^d / (1 - p + p e^d) (Gumbel-max), so a
# cheater may end there at most e^0.5 = 1.65 times as often as an honest worker (e = 2.72 times
# with the whole margin).
DEFAULT_SEEDED_EOS_DEFICIT = 0.5


def _check_u64(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < _U64:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return value


def _philox_key(seed: int, row: int) -> np.ndarray:
    digest = blake3.blake3(
        _DOMAIN + seed.to_bytes(8, "little") + row.to_bytes(8, "little")
    ).digest(length=16)
    return np.frombuffer(digest, dtype="<u8").astype(np.uint64)


def gumbel_noise(seed: int, row: int, position: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, float32 [vocab_size], for token ``position`` of sequence ``row``.

    Deterministic and platform-independent: the same arguments give the same tensor anywhere.
    """
    seed = _check_u64("seed", seed)
    row = _check_u64("row", row)
    position = _check_u64("position", position)
    vocab_size = _check_u64("vocab_size", vocab_size)
    if vocab_size == 0:
        raise ValueError("vocab_size must be positive")
    # Counter high word = position, low word counts draws within one position, so
    # positions never share Philox blocks for any vocabulary below 2**66 entries.
    bitgen = np.random.Philox(key=_philox_key(seed, row), counter=position << 64)
    raw = bitgen.random_raw(vocab_size)
    # 53-bit uniforms strictly inside (0, 1): (k + 0.5) / 2**53.
    u = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
    g = -np.log(-np.log(u))
    return torch.from_numpy(g.astype(np.float32))


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (t > 0.0 and np.isfinite(t)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    return t


def sample_tokens(
    logits: torch.Tensor,
    *,
    seed: int,
    rows: Sequence[int],
    position: int,
    temperature: float,
) -> torch.Tensor:
    """Sample one token per row: argmax(logits / T + gumbel(seed, row, position)).

    logits: [B, V] (any float dtype; computed in float32). Returns long [B].
    """
    t = _check_temperature(temperature)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if len(rows) != batch:
        raise ValueError(f"got {len(rows)} rows for a batch of {batch}")
    noise = torch.stack([gumbel_noise(seed, r, position, vocab) for r in rows])
    scores = logits.detach().float().cpu() / t + noise
    return scores.argmax(dim=-1).to(torch.long)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at the chosen tokens: float32 [B]."""
    t = _check_temperature(temperature)
    if logits.dim() != 2 or tokens.dim() != 1 or tokens.shape[0] != logits.shape[0]:
        raise ValueError(
            f"need logits [B, V] and tokens [B], got {tuple(logits.shape)}, {tuple(tokens.shape)}"
        )
    logp = torch.log_softmax(logits.float() / t, dim=-1)
    return logp.gather(1, tokens.to(device=logits.device, dtype=torch.long)[:, None])[:, 0]


@dataclass(frozen=True)
class SamplingReport:
    """Outcome of replaying seeded sampling over one sequence.

    positions_checked: how many generated tokens were replayed.
    mismatches: positions whose claimed token scored more than ``margin`` below the best
      perturbed score (empty for an honest worker).
    max_deficit: the largest deficit seen (0.0 when every token was the exact argmax);
      useful for calibration.
    last_deficit: the deficit of the final token (inf for NaN logits; 0.0 when none), which
      tells `check_termination` whether a final EOS was the seeded sample.
    """

    positions_checked: int
    mismatches: tuple[int, ...]
    max_deficit: float = 0.0
    last_deficit: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatches


def _check_tokens(tokens: Sequence[int], vocab: int) -> np.ndarray:
    arr = np.asarray(list(tokens), dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        raise ProofError(f"token ids must lie in [0, {vocab})")
    return arr


def replay_check(
    logits: torch.Tensor,
    tokens: Sequence[int],
    *,
    seed: int,
    row: int,
    temperature: float,
    margin: float = DEFAULT_MARGIN,
) -> SamplingReport:
    """Check that each generated token is the Gumbel-max sample, up to ``margin``.

    logits: [T, V], row i = the logits that produced generated token i (recomputed by one
    prefill). tokens: the T generated tokens. Raises ProofError on a length mismatch or an
    out-of-range token id (the submitter's fault).
    """
    t = _check_temperature(temperature)
    if not margin >= 0.0:
        raise ValueError(f"margin must be >= 0, got {margin!r}")
    if logits.dim() != 2:
        raise ProofError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    n_pos, vocab = logits.shape
    toks = _check_tokens(tokens, vocab)
    if toks.size != n_pos:
        raise ProofError(f"{toks.size} tokens for {n_pos} logit rows")
    if n_pos == 0:
        return SamplingReport(positions_checked=0, mismatches=())
    noise = torch.stack([gumbel_noise(seed, row, p, vocab) for p in range(n_pos)])
    scores = logits.detach().float().cpu() / t + noise
    chosen = scores.gather(1, torch.from_numpy(toks)[:, None])[:, 0]
    deficit = scores.max(dim=-1).values - chosen
    # NaN logits can never support a claim: treat them as an infinite deficit.
    deficit = torch.nan_to_num(deficit, nan=float("inf"))
    bad = torch.nonzero(deficit > margin).flatten().tolist()
    return SamplingReport(
        positions_checked=n_pos,
        mismatches=tuple(int(p) for p in bad),
        max_deficit=float(deficit.max()),
        last_deficit=float(deficit[-1]),
    )


class Termination(enum.StrEnum):
    """Why a sequence did not end legitimately (`TerminationReport.reason`)."""

    TOO_LONG = "too_long"  # more tokens than max_new_tokens
    EOS_IMPROBABLE = "eos_improbable"  # it ended with an EOS the model gave less than min_prob
    TRUNCATED = "truncated"  # it stopped short of max_new_tokens without an EOS


@dataclass(frozen=True)
class TerminationReport:
    """Whether a sequence ended legitimately.

    ok: True when it ended with an EOS that is probable or was the seeded sample, or at exactly
      max_new_tokens.
    reason: None when ok, else why not.
    eos_prob: probability of the final token under softmax(logits_last / T) when it is an
      EOS, else None.
    seeded_eos: True when an EOS below min_prob was accepted because the replay showed it was
      the seeded sample.
    """

    ok: bool
    reason: Termination | None
    eos_prob: float | None = None
    seeded_eos: bool = False


def check_termination(
    logits_last: torch.Tensor,
    last_token: int | None,
    *,
    eos_token_id: int | Sequence[int],
    max_new_tokens: int,
    n_generated: int,
    temperature: float,
    min_prob: float = DEFAULT_MIN_EOS_PROB,
    eos_deficit: float | None = None,
    seeded_deficit: float = DEFAULT_SEEDED_EOS_DEFICIT,
) -> TerminationReport:
    """A sequence must end with an EOS, or at the length limit. The EOS must have probability
    >= min_prob, or have been the seeded sample: ``eos_deficit`` (the replay's
    `SamplingReport.last_deficit`) at most ``seeded_deficit``. Without ``eos_deficit`` (no replay
    was run) only the probability counts. An EOS as the max_new_tokens-th token needs neither: the
    limit ends the sequence whatever its last token is.

    logits_last: [V], the logits that produced the final generated token (ignored when
    n_generated == 0, where last_token may be None).
    """
    t = _check_temperature(temperature)
    if max_new_tokens < 1 or n_generated < 0:
        raise ValueError("need max_new_tokens >= 1 and n_generated >= 0")
    eos_ids = {int(eos_token_id)} if isinstance(eos_token_id, (int, np.integer)) else {
        int(e) for e in eos_token_id
    }
    if n_generated > max_new_tokens:
        return TerminationReport(ok=False, reason=Termination.TOO_LONG)
    if n_generated > 0 and last_token is not None and int(last_token) in eos_ids:
        if logits_last.dim() != 1:
            raise ProofError(f"logits_last must be [V], got shape {tuple(logits_last.shape)}")
        if not 0 <= int(last_token) < logits_last.shape[0]:
            raise ProofError("EOS id lies outside the vocabulary")
        prob = float(torch.softmax(logits_last.float() / t, dim=-1)[int(last_token)])
        if prob >= min_prob:  # NaN fails this test, as it should
            return TerminationReport(ok=True, reason=None, eos_prob=prob)
        if eos_deficit is not None and eos_deficit <= seeded_deficit:  # NaN fails this one too
            return TerminationReport(ok=True, reason=None, eos_prob=prob, seeded_eos=True)
        if n_generated == max_new_tokens:  # the limit ended it anyway; the token is the replay's to judge
            return TerminationReport(ok=True, reason=None, eos_prob=prob)
        return TerminationReport(ok=False, reason=Termination.EOS_IMPROBABLE, eos_prob=prob)
    if n_generated == max_new_tokens:
        return TerminationReport(ok=True, reason=None)
    return TerminationReport(ok=False, reason=Termination.TRUNCATED)

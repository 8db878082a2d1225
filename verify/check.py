"""Check one rollout end to end: TOPLOC proofs, seeded-sampling replay, termination.

Owns: the convention for which hidden states are proven, and ``check_rollout``, which runs
one prefill through a caller-supplied ``forward`` and combines every check into a
``RolloutVerdict`` with machine-readable reason codes.
Must not: load or own a model (``forward`` is handed in), sign, send or store verdicts
(verify/verdicts.py), choose which rollouts to check (verify/assign.py).

Convention (the same as toploc's vLLM hook used by prime-rl, whose proofs cover the
hidden states handed to the logits processor, i.e. the ones that *produced* each sampled
token, with toploc's ``skip_prefill=True`` chunking): generated token i was produced by the
LM-head input at position ``len(prompt) - 1 + i`` of prompt + output. So the proven rows
are ``hidden_all[len(prompt) - 1 : len(prompt) - 1 + n_out]``; the last generated token's
own hidden state is never proven (decoding stops before computing it). Workers build
proofs with ``generated_hidden_slice`` so both sides cut the same rows.

Reason codes: toploc_exp, toploc_mant_mean, toploc_mant_median, toploc_sign (from
verify.policy), sampling_mismatch, bad_termination, malformed_proof.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from verify.errors import ProofError
from verify.policy import Thresholds, decide
from verify.sampling import (
    DEFAULT_MARGIN,
    DEFAULT_MIN_EOS_PROB,
    SamplingReport,
    TerminationReport,
    check_termination,
    replay_check,
)
from verify.toploc import ChunkStats, measure

__all__ = [
    "BAD_TERMINATION",
    "MALFORMED_PROOF",
    "SAMPLING_MISMATCH",
    "Forward",
    "RolloutVerdict",
    "check_rollout",
    "explain",
    "generated_hidden_slice",
]

SAMPLING_MISMATCH = "sampling_mismatch"
BAD_TERMINATION = "bad_termination"
MALFORMED_PROOF = "malformed_proof"

Forward = Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]


def generated_hidden_slice(hidden_all: torch.Tensor, prompt_len: int, n_out: int) -> torch.Tensor:
    """Rows of ``hidden_all`` [T, ...] that produced the ``n_out`` generated tokens.

    Works for hidden states and logits alike: rows prompt_len-1 .. prompt_len-2+n_out.
    """
    if prompt_len < 1 or n_out < 0:
        raise ProofError(f"need a non-empty prompt and n_out >= 0 (got {prompt_len}, {n_out})")
    if hidden_all.shape[0] < prompt_len - 1 + n_out:
        raise ValueError(f"{hidden_all.shape[0]} rows cannot cover {prompt_len} + {n_out}")
    return hidden_all[prompt_len - 1 : prompt_len - 1 + n_out]


@dataclass(frozen=True)
class RolloutVerdict:
    """accepted: every check passed. reasons: reason codes of the failed checks (empty when
    accepted). The reports are kept for logging and calibration; they are None where a
    check could not run (malformed input). detail: a human-readable note, never parsed."""

    accepted: bool
    reasons: tuple[str, ...]
    chunk_stats: tuple[ChunkStats, ...] = ()
    sampling: SamplingReport | None = None
    termination: TerminationReport | None = None
    detail: str = ""


def explain(verdict: RolloutVerdict) -> str:
    """One line with the numbers behind a verdict, for a log: what an operator needs to tell a
    false rejection of an honest worker from a cheat (reason codes alone do not)."""
    parts = [",".join(verdict.reasons) or "accepted"]
    if verdict.detail:
        parts.append(verdict.detail)
    t, s = verdict.termination, verdict.sampling
    if t is not None and t.eos_prob is not None:
        parts.append(f"eos p={t.eos_prob:.3g}{' (seeded)' if t.seeded_eos else ''}")
    if s is not None:
        over = ""
        if s.mismatches:
            more = f" and {len(s.mismatches) - 8} more" if len(s.mismatches) > 8 else ""
            over = f" over margin at {list(s.mismatches[:8])}{more}"
        parts.append(f"replay deficit max {s.max_deficit:.3g} last {s.last_deficit:.3g}{over}")
    stats = verdict.chunk_stats
    if stats:
        # each statistic's largest value and its chunk: what each threshold was held against (the
        # chunk worst on one statistic need not be the one that failed another)
        def most(name: str) -> str:
            at = max(range(len(stats)), key=lambda i: _order(getattr(stats[i], name)))
            value = getattr(stats[at], name)
            return f"{value:.3g} (chunk {at})" if isinstance(value, float) else f"{value} (chunk {at})"

        parts.append(f"{len(stats)} chunks, largest: exp {most('exp_mismatches')} "
                     f"mant mean {most('mant_err_mean')} median {most('mant_err_median')} "
                     f"sign {most('sign_mismatches')}")
    return "; ".join(parts)


def _order(value: float) -> tuple[bool, float]:
    """NaN sorts above everything, inf included (a statistic that cannot be compared is the one to show)."""
    return (True, 0.0) if math.isnan(value) else (False, value)


def _malformed(detail: str) -> RolloutVerdict:
    return RolloutVerdict(accepted=False, reasons=(MALFORMED_PROOF,), detail=detail)


def _token_list(name: str, ids: Sequence[int], vocab_size: int | None) -> list[int]:
    try:
        out = [int(t) for t in ids]
    except (TypeError, ValueError) as exc:
        raise ProofError(f"{name} must be a sequence of ints") from exc
    hi = vocab_size if vocab_size is not None else 1 << 62
    if any(not 0 <= t < hi for t in out):
        raise ProofError(f"{name} holds a token id outside [0, {hi})")
    return out


def _run_forward(forward: Forward, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, logits = forward(ids)
    if hidden.dim() != 2 or logits.dim() != 2 or hidden.shape[0] != len(ids) \
            or logits.shape[0] != len(ids):
        raise ValueError(  # our forward broke its contract: not the submitter's fault
            f"forward returned hidden {tuple(hidden.shape)} / logits {tuple(logits.shape)} "
            f"for {len(ids)} tokens"
        )
    return hidden, logits


def check_rollout(
    forward: Forward,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    proofs: Sequence[bytes],
    *,
    seed: int,
    row: int,
    temperature: float,
    eos_token_id: int | Sequence[int],
    max_new_tokens: int,
    thresholds: Thresholds = Thresholds(),
    margin: float = DEFAULT_MARGIN,
    min_eos_prob: float = DEFAULT_MIN_EOS_PROB,
    vocab_size: int | None = None,
    chunk_tokens: int = 32,
    topk: int = 128,
    exact_ties: bool = True,
) -> RolloutVerdict:
    """Recompute the rollout in one prefill and run every check.

    Malformed input (bad ids, bad proof bytes, wrong proof count) gives a rejected verdict
    with ``malformed_proof``, never an exception; a ``forward`` that breaks its contract
    raises ValueError (the validator's own fault). ``exact_ties`` is the tie rule of
    ``verify.toploc.measure``: pass the one the calibration tables deciding on these
    statistics were measured with (``CalibrationTables.exact_ties``).
    """
    try:
        prompt = _token_list("prompt_ids", prompt_ids, vocab_size)
        output = _token_list("output_ids", output_ids, vocab_size)
        if not prompt:
            raise ProofError("empty prompt")
    except ProofError as exc:
        return _malformed(str(exc))
    eos_ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)

    hidden_all, logits_all = _run_forward(forward, prompt + output)
    hidden = generated_hidden_slice(hidden_all, len(prompt), len(output))
    logits = generated_hidden_slice(logits_all, len(prompt), len(output))
    try:
        stats = measure(hidden, proofs, chunk_tokens=chunk_tokens, topk=topk, exact_ties=exact_ties)
        sampling = replay_check(logits, output, seed=seed, row=row,
                                temperature=temperature, margin=margin)
    except ProofError as exc:
        return _malformed(str(exc))

    decision = decide(stats, thresholds)
    reasons = list(decision.reasons)
    if not sampling.ok:
        reasons.append(SAMPLING_MISMATCH)
    termination = check_termination(
        logits[-1] if output else logits_all[-1],
        output[-1] if output else None,
        eos_token_id=eos_token_id,
        max_new_tokens=max_new_tokens,
        n_generated=len(output),
        temperature=temperature,
        min_prob=min_eos_prob,
        eos_deficit=sampling.last_deficit if output else None,
    )
    eos_inside = any(t in eos_ids for t in output[:-1])
    if not termination.ok or eos_inside:
        reasons.append(BAD_TERMINATION)
    detail = "eos before the last token" if eos_inside else (termination.reason.value if termination.reason else "")
    return RolloutVerdict(
        accepted=not reasons,
        reasons=tuple(reasons),
        chunk_stats=tuple(stats),
        sampling=sampling,
        termination=termination,
        detail=detail,
    )

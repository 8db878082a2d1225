"""The submission-level test: its false-rejection bound, its power, the recent-rollout pool,
the calibration tables it reads, and how the validator's checker applies it and the presets."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from verify.calibration import DEFAULT_TABLES, CalibrationTables, load_tables, tables_to_json
from verify.policy import (AGGREGATE, SAME_STACK, PairCalibration, RecentRollouts, StatCalibration, Thresholds,
                           decide_aggregate, kl_bernoulli, kl_upper_bound)
from verify.toploc import ChunkStats

torch.set_num_threads(1)

LOW = ChunkStats(exp_mismatches=0, mant_err_mean=1.0, mant_err_median=1.0, sign_mismatches=0)
HIGH = ChunkStats(exp_mismatches=9, mant_err_mean=3.0, mant_err_median=2.0, sign_mismatches=1)


def _pair(rate: float = 0.1, *, exact: bool = False, worker: str = "bf16/torch/cpu",
          validator: str = "fp32/torch/cpu") -> PairCalibration:
    return PairCalibration(worker, validator, exact,
                           (("mant_err_mean", StatCalibration(2.0, rate)), ("exp_mismatches", StatCalibration(4, rate))),
                           honest_chunks=1000, honest_rollouts=500)


def _rollouts(rng: np.random.Generator, n: int, p_high: float, chunks: int = 2, correlated: bool = False):
    out = []
    for _ in range(n):
        if correlated:  # every chunk of a rollout alike: the worst case for chunk-level pooling
            out.append([HIGH if rng.random() < p_high else LOW] * chunks)
        else:
            out.append([HIGH if rng.random() < p_high else LOW for _ in range(chunks)])
    return out


def test_kl_and_its_upper_confidence_bound():
    assert kl_bernoulli(0.5, 0.5) == 0.0
    assert kl_bernoulli(1.0, 0.1) == pytest.approx(math.log(10))
    assert kl_bernoulli(0.2, 0.0) == math.inf
    up = kl_upper_bound(0.1, 500, 0.01)
    assert up > 0.1 and 500 * kl_bernoulli(0.1, up) == pytest.approx(math.log(100), rel=1e-6)
    assert kl_upper_bound(0.0, 250, 0.01) == pytest.approx(1 - math.exp(-math.log(100) / 250), rel=1e-6)


@pytest.mark.parametrize("correlated", [False, True])
def test_honest_submissions_are_rejected_at_most_alpha_of_the_time(correlated):
    """Honest rollouts exceed at the calibrated rate: rejections stay within alpha (plus
    binomial noise on 3,000 draws), chunks within a rollout correlated or not."""
    rng = np.random.default_rng(1 + correlated)
    alpha, n = 0.02, 3000
    rejected = sum(not decide_aggregate(_rollouts(rng, 16, 0.1, correlated=correlated), _pair(0.1), alpha).accepted
                   for _ in range(n))
    assert rejected <= alpha * n + 4 * math.sqrt(alpha * n)


def test_a_shifted_submission_is_rejected_and_named():
    rng = np.random.default_rng(3)
    decision = decide_aggregate(_rollouts(rng, 16, 0.8), _pair(0.1), 1e-4)
    assert not decision.accepted and decision.reasons == (AGGREGATE,)
    assert max(e for _, e in decision.evidence) >= decision.limit_nats == pytest.approx(math.log(2 / 1e-4))


def test_one_rollout_is_not_enough_evidence():
    """Even a rollout whose every chunk exceeds cannot reach alpha = 1e-4 alone."""
    assert decide_aggregate([[HIGH, HIGH]], _pair(0.1), 1e-4).accepted


def test_recent_rollouts_catch_a_worker_that_cheats_a_little_every_time():
    pool = RecentRollouts(window_rollouts=256)
    rng = np.random.default_rng(4)
    first_rejection = None
    for i in range(40):  # 4 rollouts per submission, each exceeding half the time
        decision = pool.decide("cheat", _rollouts(rng, 4, 0.5), _pair(0.1), 1e-4)
        assert decision.rollouts == 4
        if not decision.accepted:
            first_rejection = i
            break
        assert decide_aggregate(_rollouts(rng, 4, 0.5), _pair(0.1), 1e-4).accepted  # alone: never
    assert first_rejection is not None and first_rejection >= 2
    # the evidence that convicted it is spent: the next submission starts a new pool
    assert pool.decide("cheat", _rollouts(rng, 4, 0.1), _pair(0.1), 1e-4).recent_rollouts == 4


def test_recent_rollouts_keep_workers_and_stack_pairs_apart():
    pool = RecentRollouts(window_rollouts=64, max_keys=2)
    rng = np.random.default_rng(5)
    for _ in range(30):
        assert pool.decide("honest", _rollouts(rng, 4, 0.05), _pair(0.1), 1e-4).accepted
    other = pool.decide("other", _rollouts(rng, 4, 0.05), _pair(0.1), 1e-4)
    assert other.recent_rollouts == 4
    assert pool.decide("honest", _rollouts(rng, 4, 0.05), _pair(0.1, worker="fp32/torch/cpu"),
                       1e-4).recent_rollouts == 4
    assert len(pool._pools) == 2  # bounded


def test_shipped_tables_cover_the_cpu_stack_pairs_and_no_bf16_pair_is_bit_exact():
    tables = load_tables()
    for worker in ("fp32/torch/cpu", "bf16/torch/cpu"):
        for validator in ("fp32/torch/cpu", "bf16/torch/cpu"):
            pair = tables.get(worker, validator)
            assert pair is not None and pair.honest_chunks > 0 and pair.honest_rollouts > 0
            assert not pair.bit_exact or (worker, validator) == ("fp32/torch/cpu", "fp32/torch/cpu")


def test_tables_round_trip_and_broken_files_are_named(tmp_path: Path):
    path = tmp_path / "t.json"
    path.write_text(tables_to_json([_pair(0.2, exact=True)], {"model": "x"}))
    again = load_tables(path)
    assert again.get("bf16/torch/cpu", "fp32/torch/cpu") == _pair(0.2, exact=True)
    assert again.meta["model"] == "x"
    broken = json.loads(path.read_text())
    del broken["pairs"][0]["stats"]["exp_mismatches"]
    path.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="pair stats"):
        load_tables(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_tables(tmp_path / "missing.json")
    assert DEFAULT_TABLES.name == "calibration_tables.json"


# ----------------------------------------------------------------------------- the validator's checker


def test_same_stack_preset_refuses_to_start_where_nothing_was_measured_bit_exact(tmp_path: Path):
    from p2pnet.errors import ConfigError
    from verify.daemon import ValidatorConfig

    exact = tmp_path / "exact.json"
    exact.write_text(tables_to_json([_pair(exact=True, worker="fp32/torch/cpu")], {}))
    inexact = tmp_path / "inexact.json"
    inexact.write_text(tables_to_json([_pair(exact=False, worker="fp32/torch/cpu")], {}))
    ValidatorConfig(threshold_preset="same_stack", calibration_file=exact)  # measured bit-exact: starts
    with pytest.raises(ConfigError, match=r"bit-exact pairs: none\); this validator is fp32/torch/cpu"):
        ValidatorConfig(threshold_preset="same_stack", calibration_file=inexact)
    with pytest.raises(ConfigError, match="this validator is fp32/torch/cuda"):
        ValidatorConfig(threshold_preset="same_stack", calibration_file=exact, device="cuda:0")
    with pytest.raises(ConfigError, match="calibration_file"):
        ValidatorConfig(calibration_file=tmp_path / "missing.json")


def test_same_stack_thresholds_apply_only_to_bit_exact_pairs():
    from verify.daemon import SubmissionChecker

    checker = SubmissionChecker(lambda v: None, preset="same_stack")
    assert checker._thresholds(_pair(exact=True)) == SAME_STACK
    assert checker._thresholds(_pair(exact=False)) == Thresholds()
    assert checker._thresholds(None) == Thresholds()


def _tiny_submission(stack):
    from verify.messages import Submission, rollout_record
    from verify.testing import generate, tiny_model

    worker = tiny_model(dtype=torch.bfloat16)
    rng = np.random.default_rng(0)
    records = []
    for row in range(8):
        prompt = rng.integers(3, 512, size=12).tolist()
        g = generate(worker, prompt, seed=5, row=row, max_new_tokens=64, temperature=1.0, eos_token_id=2)
        from verify.toploc import build_proofs

        records.append(rollout_record(prompt_ids=prompt, output_ids=g.output_ids, logprobs=[0.0] * len(g.output_ids),
                                      proofs=build_proofs(g.hidden),
                                      stop_reason="eos" if g.output_ids[-1] == 2 else "length", row=row))
    return Submission(model="tiny", model_version=0, step=0, seed=5, task_seed=1, prompts_per_submission=8,
                      group_size=1, temperature=1.0, max_new_tokens=64, rollouts=tuple(records),
                      nonce=b"n" * 16, stack=stack)


def test_checker_rejects_an_implausible_submission_that_every_chunk_threshold_passes(caplog):
    """A bf16 worker's honest rollouts checked by an fp32 validator pass the paper's per-chunk
    thresholds; against a (deliberately wrong) table claiming that pair is exact, the pooled
    test rejects them, and against a table with the right limits it accepts them."""
    from verify.daemon import LoadedModel, SubmissionChecker
    from verify.messages import Stack
    from verify.testing import make_forward, tiny_model
    from verify.validator import CheckRequested

    fp32 = tiny_model(dtype=torch.float32)
    fp32.load_state_dict({k: v.float() for k, v in tiny_model(dtype=torch.bfloat16).state_dict().items()})
    model = LoadedModel(make_forward(fp32), None, 2, 512, "tiny", module=fp32)
    sub = _tiny_submission(Stack("bf16", "torch", "cpu"))
    request = CheckRequested(b"s" * 32, "worker", sub, b"t" * 64, tuple(range(8)))

    def checker(limit: float, rate: float) -> SubmissionChecker:
        pair = PairCalibration("bf16/torch/cpu", "fp32/torch/cpu", False,
                               (("mant_err_mean", StatCalibration(limit, rate)),
                                ("exp_mismatches", StatCalibration(127, rate))), 10, 5)
        return SubmissionChecker(lambda v: model, tables=CalibrationTables([pair]), aggregate_alpha=1e-3)

    strict = checker(0.0, 0.01)
    with caplog.at_level(logging.INFO, logger="verify.daemon"):
        accepted, reasons = strict(request)
    assert not accepted and reasons == (AGGREGATE,)
    # the evidence is logged: a batch refused whole names no row, and its reason code no number
    (line,) = [r.getMessage() for r in caplog.records if "submission-level test" in r.getMessage()]
    assert line.startswith("worker worker step 0 version 0 rejected by the submission-level test: "
                           "submission:mant_err_mean ") and "(limit " in line and "; 8 rollouts, 8 recent)" in line
    assert strict.aggregate_counts == {"tested": 1, "rejected": 1, "uncalibrated": 0}
    assert checker(10.0, 0.1)(request) == (True, ())
    undeclared = _tiny_submission(Stack("unknown", "unknown", "unknown"))
    plain = checker(0.0, 0.01)
    assert plain(CheckRequested(b"s" * 32, "worker", undeclared, b"t" * 64, tuple(range(8)))) == (True, ())
    assert plain.aggregate_counts["uncalibrated"] == 1


def test_tables_measured_on_another_model_do_not_apply():
    """A table names the model it was measured on; a validator serving another model does not
    use it (no pooled test, no same_stack), it counts the submission as uncalibrated."""
    from verify.calibration import model_fingerprint
    from verify.daemon import LoadedModel, SubmissionChecker
    from verify.messages import Stack
    from verify.testing import make_forward, tiny_model
    from verify.validator import CheckRequested

    fp32 = tiny_model(dtype=torch.float32)
    model = LoadedModel(make_forward(fp32), None, 2, 512, "tiny", module=fp32)
    strict = PairCalibration("bf16/torch/cpu", "fp32/torch/cpu", True,
                             (("mant_err_mean", StatCalibration(0.0, 0.01)),
                              ("exp_mismatches", StatCalibration(0, 0.01))), 10, 5)
    other = dict(model_fingerprint(fp32.config), hidden_size=576)
    checker = SubmissionChecker(lambda v: model, tables=CalibrationTables([strict], {"model_config": other}),
                                aggregate_alpha=1e-3, preset="same_stack")
    assert checker._pair("bf16/torch/cpu", model) is None
    sub = _tiny_submission(Stack("bf16", "torch", "cpu"))
    assert checker(CheckRequested(b"s" * 32, "w", sub, b"t" * 64, tuple(range(8)))) == (True, ())
    assert checker.aggregate_counts["uncalibrated"] == 1
    same = SubmissionChecker(lambda v: model, tables=CalibrationTables([strict], {"model_config": model_fingerprint(fp32.config)}))
    assert same._pair("bf16/torch/cpu", model) == strict


def test_undeclared_stacks_can_be_held_to_the_loosest_measured_pair():
    """uncalibrated_stacks = "loosest": a worker that declares nothing (or an unmeasured stack)
    is tested against the loosest pair measured with this validator's stack."""
    from verify.daemon import LoadedModel, SubmissionChecker
    from verify.testing import make_forward, tiny_model

    fp32 = tiny_model(dtype=torch.float32)
    model = LoadedModel(make_forward(fp32), None, 2, 512, "tiny", module=fp32)
    tables = CalibrationTables([_pair(0.1), _pair(0.3, worker="fp32/torch/cpu"),
                                _pair(0.5, validator="bf16/torch/cpu")])
    loosest = tables.loosest_for("fp32/torch/cpu")
    assert loosest.stat("mant_err_mean").exceed_rate == 0.3 and not loosest.bit_exact
    assert tables.loosest_for("fp16/torch/cuda") is None
    assert SubmissionChecker(lambda v: model, tables=tables)._pair("unknown/unknown/unknown", model) is None
    strict = SubmissionChecker(lambda v: model, tables=tables, uncalibrated_stacks="loosest")
    assert strict._pair("unknown/unknown/unknown", model) == loosest
    assert strict._pair("bf16/torch/cpu", model) == _pair(0.1)


def test_a_rejected_row_is_logged_with_the_numbers_behind_it(caplog):
    """Reason codes alone cannot tell a false rejection of an honest worker from a cheat: the
    validator logs, for each rejected row, the termination's detail and EOS probability, the
    replay's deficits and the worst chunk's statistics (an unexplained honest rejection in a
    devnet run left only `row<i>:bad_termination` behind)."""
    import dataclasses
    import logging

    from verify.daemon import LoadedModel, SubmissionChecker
    from verify.messages import Stack, rollout_record
    from verify.testing import make_forward, tiny_model
    from verify.validator import CheckRequested

    model = LoadedModel(make_forward(tiny_model(dtype=torch.bfloat16)), None, 2, 512, "tiny")
    sub = _tiny_submission(Stack("bf16", "torch", "cpu"))
    short = next(r for r in sub.rollouts if r.stop_reason == "eos")
    output = list(short.output)
    output[-1] = 7  # the EOS the worker sampled replaced by a token it did not sample: ends short, no EOS
    changed = rollout_record(prompt_ids=list(short.prompt), output_ids=output, logprobs=[0.0] * len(output),
                             proofs=short.proofs, stop_reason="length", row=short.row)
    rollouts = tuple(changed if r.row == short.row else r for r in sub.rollouts)
    request = CheckRequested(b"s" * 32, "w", dataclasses.replace(sub, rollouts=rollouts), b"t" * 64, tuple(range(8)))
    with caplog.at_level(logging.INFO, logger="verify.daemon"):
        accepted, reasons = SubmissionChecker(lambda v: model)(request)
    assert not accepted and reasons == (f"row{short.row}:sampling_mismatch", f"row{short.row}:bad_termination")
    lines = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"step 0 version 0 row {short.row} rejected: sampling_mismatch,bad_termination; truncated; " \
           "replay deficit max " in lines[0]
    assert f"over margin at [{len(output) - 1}]; " in lines[0] and "chunks, largest: exp 0 (chunk 0) " in lines[0]

"""The tie rule of verify.toploc.measure is a property of the calibration tables.

Tables name the rule their figures were measured with (``ties``: "exact", also when the field
is absent; or "open", as in the shipped file); an unknown rule is refused naming the file and
the field; verify.check.check_rollout measures with the rule it is given, and the validator's
checker gives it the rule of its tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import verify.check
from verify.calibration import CalibrationTables, load_tables, tables_to_json
from verify.policy import PairCalibration, StatCalibration
from verify.toploc import ChunkStats, _prove, build_proofs

pytestmark = pytest.mark.usefixtures("topk_path")  # with and without verify's C module (conftest)

torch.set_num_threads(1)

ZERO = ChunkStats(0, 0.0, 0.0, 0)
PAIR = PairCalibration("bf16/torch/cpu", "fp32/torch/cpu", False,
                       (("mant_err_mean", StatCalibration(10.0, 0.1)), ("exp_mismatches", StatCalibration(127, 0.1))),
                       honest_chunks=10, honest_rollouts=5)


SAME = PairCalibration("bf16/torch/cpu", "bf16/torch/cpu", False, PAIR.stats, honest_chunks=10, honest_rollouts=5)


def _write(path: Path, pairs: tuple[PairCalibration, ...] = (PAIR,), **meta) -> Path:
    path.write_text(tables_to_json(list(pairs), {"model": "x", **meta}))
    return path


def test_tables_without_the_field_are_exact_and_open_loads_as_open(tmp_path: Path):
    shipped = load_tables()  # measured with scripts/calibrate.py --ties open (docs/calibration.md)
    assert shipped.meta["ties"] == "open" and shipped.ties == "open" and not shipped.exact_ties
    plain = load_tables(_write(tmp_path / "plain.json"))
    assert plain.ties == "exact" and plain.exact_ties
    assert CalibrationTables([PAIR]).exact_ties
    opened = load_tables(_write(tmp_path / "open.json", ties="open"))
    assert opened.ties == "open" and not opened.exact_ties
    assert json.loads((tmp_path / "open.json").read_text())["ties"] == "open"
    assert load_tables(_write(tmp_path / "exact.json", ties="exact")).exact_ties


@pytest.mark.parametrize("bad", ["Open", "torch", None, 1])
def test_an_unknown_tie_rule_names_the_file_and_the_field(tmp_path: Path, bad):
    from p2pnet.errors import ConfigError
    from verify.daemon import ValidatorConfig

    path = _write(tmp_path / "bad.json", ties=bad)
    with pytest.raises(ValueError, match=r"bad\.json.*\"ties\" must be one of \['exact', 'open'\]"):
        load_tables(path)
    with pytest.raises(ConfigError, match="calibration_file"):
        ValidatorConfig(calibration_file=path)


def _other_tie_breaking() -> tuple[torch.Tensor, list[bytes], list[bytes]]:
    """One 32-token chunk whose 128th place is tied among 200 entries, with torch's honest
    proof and a proof that keeps the last tied entries instead (a valid top-k set too)."""
    rng = np.random.default_rng(3)
    flat = torch.full((32 * 64,), 0.25, dtype=torch.bfloat16)
    spots = rng.permutation(flat.numel())
    flat[spots[:100]] = 4.0
    flat[spots[100:300]] = -2.0
    hidden = flat.reshape(32, 64)
    above, tied = np.sort(spots[:100]), np.sort(spots[100:300])
    idx = np.concatenate([above, tied[::-1][:28]])[None, :].astype(np.int64)
    bits = flat.view(torch.int16).numpy().view(np.uint16).astype(np.int64)[idx]
    return hidden, build_proofs(hidden), _prove((idx, bits))


def test_check_rollout_measures_with_the_rule_it_is_given():
    hidden, honest, other = _other_tie_breaking()
    prompt, output = [1], list(range(3, 35))
    states = torch.cat([hidden, torch.zeros(1, 64, dtype=torch.bfloat16)])  # the last row is never proven

    def forward(ids):
        return states, torch.zeros(len(ids), 50)

    def stats(proofs, **kw):
        return check_rollout_stats(forward, prompt, output, proofs, **kw)

    assert stats(honest) == stats(honest, exact_ties=False) == [ZERO]
    assert stats(other, exact_ties=False) == [ZERO]
    exact = stats(other)  # the default: torch's choice, which the paper's thresholds assume
    assert exact == stats(other, exact_ties=True) and exact[0].exp_mismatches > 0


def check_rollout_stats(forward, prompt, output, proofs, **kw) -> list[ChunkStats]:
    verdict = verify.check.check_rollout(forward, prompt, output, proofs, seed=1, row=0, temperature=1.0,
                                         eos_token_id=2, max_new_tokens=len(output), **kw)
    return list(verdict.chunk_stats)


@pytest.mark.parametrize("ties,fits", [(None, True), ("exact", True), ("open", True), ("open", False)])
def test_the_checker_measures_with_the_rule_of_its_tables(tmp_path: Path, monkeypatch, ties, fits):
    """The validator's checker hands measure the rule of its tables (spied on the real call), and
    torch's choice where no pair of those tables judges the statistics (the paper's thresholds)."""
    from verify.daemon import LoadedModel, SubmissionChecker
    from verify.messages import Stack, Submission, rollout_record
    from verify.testing import generate, make_forward, tiny_model
    from verify.validator import CheckRequested

    worker = tiny_model(dtype=torch.bfloat16)
    records = []
    for row in range(2):
        prompt = [5, 17, 301, 44, 9 + row]
        g = generate(worker, prompt, seed=5, row=row, max_new_tokens=40, temperature=1.0, eos_token_id=2)
        records.append(rollout_record(prompt_ids=prompt, output_ids=g.output_ids, logprobs=[0.0] * len(g.output_ids),
                                      proofs=build_proofs(g.hidden),
                                      stop_reason="eos" if g.output_ids[-1] == 2 else "length", row=row))
    sub = Submission(model="tiny", model_version=0, step=0, seed=5, task_seed=1, prompts_per_submission=2,
                     group_size=1, temperature=1.0, max_new_tokens=40, rollouts=tuple(records),
                     nonce=b"n" * 16, stack=Stack("bf16", "torch", "cpu"))
    model = LoadedModel(make_forward(worker), None, 2, 512, "tiny", module=worker)
    meta = {} if ties is None else {"ties": ties}
    tables = load_tables(_write(tmp_path / "t.json", (PAIR, SAME) if fits else (PAIR,), **meta))
    seen: list[bool] = []
    real = verify.check.measure

    def spy(*args, exact_ties, **kw):
        seen.append(exact_ties)
        return real(*args, exact_ties=exact_ties, **kw)

    monkeypatch.setattr(verify.check, "measure", spy)
    checker = SubmissionChecker(lambda v: model, tables=tables, aggregate_alpha=1e-3)
    assert checker(CheckRequested(b"s" * 32, "worker", sub, b"t" * 64, (0, 1))) == (True, ())
    assert seen == [ties != "open" or not fits] * 2
    assert SubmissionChecker(lambda v: model).exact_ties  # no tables: torch's choice

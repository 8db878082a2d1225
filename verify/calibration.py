"""Calibration tables: how honest recomputation looks per (worker stack, validator stack) pair.

Owns: the shipped data file (verify/calibration_tables.json, written by scripts/calibrate.py
from measured honest runs), reading and validating it into ``verify.policy.PairCalibration``
values, and the lookup by stack keys.
Must not: measure anything or decide anything (verify.policy decides with these tables).

Tables are per model as well: honest noise depends on the model. A table file names the
model it was measured on (``model_config``: model type and sizes from its config) and applies
only to validators whose loaded model has that config; a file without it applies to any.

Tables also name the tie rule their figures were measured with (``ties``, see
``verify.toploc.measure``): "exact" (torch's choice among entries tied at the k-th place, as
toploc's verify; a file without the field was measured so) or "open" (the validator counts the
tied entries the proof matches best; about 3x faster). The statistics of a proof over
differing hidden states depend on the rule, so a validator measures with its tables' rule
(``CalibrationTables.exact_ties``); scripts/calibrate.py ``--ties`` picks it.

A stack key is "dtype/backend/device" (verify.messages.Stack.key): for example
"bf16/torch/cpu" for a worker generating with trainer.rollout in bf16 on a CPU. Pairs absent
from the table are uncalibrated: the submission-level test cannot run for them, and the
``same_stack`` preset never applies to them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verify.policy import AGGREGATE_STATS, PairCalibration, StatCalibration

__all__ = ["DEFAULT_TABLES", "TIES", "CalibrationTables", "load_tables", "model_fingerprint", "tables_to_json"]

DEFAULT_TABLES = Path(__file__).with_name("calibration_tables.json")
FORMAT = 1
MODEL_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
TIES = ("exact", "open")  # tie rules a table can be measured with; absent means "exact"


def model_fingerprint(config: Any) -> dict[str, Any]:
    """The config fields that identify which model a table was measured on."""
    return {key: getattr(config, key, None) for key in MODEL_KEYS}


class CalibrationTables:
    """The pairs of one table file, looked up by (worker key, validator key), and the tie
    rule (``ties``) they were measured with. ValueError for an unknown tie rule."""

    def __init__(self, pairs: list[PairCalibration], meta: dict[str, Any] | None = None) -> None:
        self.pairs = {(p.worker, p.validator): p for p in pairs}
        self.meta = dict(meta or {})
        self.ties = self.meta.get("ties", "exact")
        if self.ties not in TIES:
            raise ValueError(f"field \"ties\" must be one of {list(TIES)} (absent means \"exact\"), "
                             f"got {self.ties!r}")

    @property
    def exact_ties(self) -> bool:
        """What to pass to verify.toploc.measure / verify.check.check_rollout: measure as these
        tables were measured."""
        return self.ties == "exact"

    def applies_to(self, model_config: Any) -> bool:
        """True when these tables were measured on a model with this config (or name none)."""
        wanted = self.meta.get("model_config")
        return wanted is None or model_fingerprint(model_config) == wanted

    def get(self, worker: str, validator: str) -> PairCalibration | None:
        return self.pairs.get((worker, validator))

    def bit_exact_pairs(self) -> list[tuple[str, str]]:
        return sorted(k for k, p in self.pairs.items() if p.bit_exact)

    def validators_with_bit_exact_pair(self) -> set[str]:
        return {v for (_, v), p in self.pairs.items() if p.bit_exact}

    def loosest_for(self, validator: str) -> PairCalibration | None:
        """For workers whose declared stack has no pair: per statistic the largest limit and
        exceed rate of any measured pair with this validator stack (never bit-exact), or None."""
        mine = [p for (_, v), p in self.pairs.items() if v == validator]
        if not mine:
            return None
        stats = tuple((name, StatCalibration(max(p.stat(name).limit for p in mine),
                                             max(p.stat(name).exceed_rate for p in mine)))
                      for name in AGGREGATE_STATS)
        return PairCalibration("*", validator, False, stats, min(p.honest_chunks for p in mine),
                               min(p.honest_rollouts for p in mine))


def _pair(raw: Any) -> PairCalibration:
    if not isinstance(raw, dict):
        raise ValueError("each pair must be a table")
    stats = raw.get("stats")
    if not isinstance(stats, dict) or sorted(stats) != sorted(AGGREGATE_STATS):
        raise ValueError(f"pair stats must be exactly {sorted(AGGREGATE_STATS)}")
    try:
        return PairCalibration(
            worker=str(raw["worker"]), validator=str(raw["validator"]), bit_exact=bool(raw["bit_exact"]),
            stats=tuple((name, StatCalibration(float(stats[name]["limit"]), float(stats[name]["exceed_rate"])))
                        for name in AGGREGATE_STATS),
            honest_chunks=int(raw["honest_chunks"]), honest_rollouts=int(raw["honest_rollouts"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"pair is missing or mistypes a field ({exc})") from exc


def load_tables(path: str | Path | None = None) -> CalibrationTables:
    """Read a table file (default: the shipped one). ValueError says what is wrong with it."""
    path = Path(path) if path is not None else DEFAULT_TABLES
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read calibration tables {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration tables {path} are not JSON: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("pairs"), list):
        raise ValueError(f"calibration tables {path}: expected format {FORMAT} with a list of pairs")
    try:
        pairs = [_pair(p) for p in raw["pairs"]]
        return CalibrationTables(pairs, {k: v for k, v in raw.items() if k != "pairs"})
    except ValueError as exc:
        raise ValueError(f"calibration tables {path}: {exc}") from exc


def tables_to_json(pairs: list[PairCalibration], meta: dict[str, Any]) -> str:
    """The file format ``load_tables`` reads (used by scripts/calibrate.py). ``meta`` should
    name the tie rule (``ties``); without it the file reads as "exact"."""
    out = {"format": FORMAT, **meta, "pairs": [
        {"worker": p.worker, "validator": p.validator, "bit_exact": p.bit_exact,
         "honest_chunks": p.honest_chunks, "honest_rollouts": p.honest_rollouts,
         "stats": {name: {"limit": cal.limit, "exceed_rate": cal.exceed_rate} for name, cal in p.stats}}
        for p in pairs]}
    return json.dumps(out, indent=1) + "\n"

"""Running scenarios and sweeps, and writing what they found: results.json, CSV and PNG plots.

`run_scenario(config)` dispatches on the scenario's type (`simulations.scenarios`) to the
runner that drives the real cores (`hostile.run_broadcast`, `audit.run_audit`,
`inference_wait.run_inference_wait`) and returns a `RunResult`: a summary of scalars, one
table of rows and the config. `write_outputs(result, out_dir)` writes

- `results.json`: the summary and the full config. Byte for byte the same for the same
  scenario and seed, on any machine and PYTHONHASHSEED, except `wall_s`.
- `<table>.csv`: per peer (broadcast), per worker (audit) or per step (inference_wait).
- `<name>.png`: the scenario's plot (matplotlib, Agg backend).

`sweep(...)` runs the cartesian product of parameter values over several seeds and writes
`sweep.csv`, `sweep.json` and `sweep.png`, reporting a progress line per run.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from simulations.scenarios import (AuditScenario, BroadcastScenario, InferenceWaitScenario, Scenario, scenario,
                                   to_jsonable, with_params)

#: the scalar each kind of scenario is judged by, in sweeps and plots
MAIN_METRIC = {BroadcastScenario: "time_to_all_s", AuditScenario: "cheater_expected_gain",
               InferenceWaitScenario: "inference_wait_mean_s"}


@dataclass
class RunResult:
    config: Scenario
    summary: dict[str, Any]
    table: str
    rows: list[dict[str, Any]]

    @property
    def main_metric(self) -> str:
        return MAIN_METRIC[type(self.config)]


def run_scenario(config: Scenario) -> RunResult:
    if isinstance(config, BroadcastScenario):
        from simulations.hostile import run_broadcast

        summary, rows, _ = run_broadcast(config)
        return RunResult(config, summary, "peers", rows)
    if isinstance(config, AuditScenario):
        from simulations.audit import run_audit

        summary, rows = run_audit(config)
        return RunResult(config, summary, "workers", rows)
    if isinstance(config, InferenceWaitScenario):
        from simulations.inference_wait import run_inference_wait

        summary, rows = run_inference_wait(config)
        return RunResult(config, summary, "steps", rows)
    raise TypeError(f"not a scenario: {type(config).__name__}")


# -- writing ------------------------------------------------------------------------------------


def results_json(result: RunResult) -> str:
    return json.dumps({**result.summary, "config": to_jsonable(result.config)}, indent=2, allow_nan=False) + "\n"


def write_outputs(result: RunResult, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / f"{result.table}.csv"]
    written[0].write_text(results_json(result))
    write_csv(written[1], result.rows)
    png = out_dir / f"{result.config.name}.png"
    plot_result(result, png)
    return written + [png]


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as fh:
        if not rows:
            return
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    pyplot().close(fig)


def plot_result(result: RunResult, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    s, rows = result.summary, result.rows
    if isinstance(result.config, BroadcastScenario):
        for kind, colour in (("honest", "C0"), ("joiner", "C2")):
            times = sorted(r["completed_s"] for r in rows if r["kind"] == kind and r["fate"] == "stayed"
                           and r["completed_s"] is not None)
            if times:
                ax.step(times, [(i + 1) / len(times) for i in range(len(times))], where="post", color=colour,
                        label=f"{kind} relays ({len(times)})")
        ax.axvline(s["lower_bound_s"], color="k", linestyle="--", label=f"lower bound {s['lower_bound_s']:.2f} s")
        ax.set_xlabel("virtual time since publish (s)")
        ax.set_ylabel("share holding the checkpoint")
        ax.set_title(f"{s['scenario']}: {s['peers']} relays, {s['checkpoint_bytes'] / 1e9:g} GB ({s['strategy']})")
    elif isinstance(result.config, AuditScenario):
        ks = list(range(1, len(s["p_caught_within_k"]) + 1))
        ax.plot(ks, s["p_caught_within_k"], "o", label="simulated")
        ax.plot(ks, s["p_caught_within_k_closed_form"], "-", label="1-(1-p)^k")
        ax.set_xlabel("forged submissions k")
        ax.set_ylabel("P(caught within k)")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"audit: sample rate {s['sample_rate']}, detection {s['detection_rate']}")
    else:
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["inference_wait_mean_s"] for r in rows], label="inference wait (mean)")
        ax.plot(steps, [r["trainer_idle_s"] for r in rows], label="trainer idle")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.set_title(f"inference wait: {s['upload_bps'] * 8 / 1e9:g} Gbit/s, async {s['async_level']}")
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    save(fig, path)


# -- sweeps ---------------------------------------------------------------------------------------


def parse_params(specs: list[str]) -> dict[str, list[str]]:
    """["churn.departures=0,0.1", "peers=100,300"] -> {"churn.departures": ["0", "0.1"], ...}."""
    params: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        if not sep or not name or not values:
            from p2pnet.errors import ConfigError

            raise ConfigError("--param", f"expected NAME=V1,V2,..., got {spec!r}")
        params[name.strip()] = [v.strip() for v in values.split(",") if v.strip()]
    return params


def sweep(name: str, params: dict[str, list[str]], *, seeds: int = 1, peers: int | None = None,
          fixed: dict[str, str] | None = None, out_dir: Path, progress: TextIO | None = None,
          run: Callable[[Scenario], RunResult] = run_scenario) -> list[dict[str, Any]]:
    """Run every combination of `params` for seeds 0..seeds-1; one row per run. A progress line
    per run goes to `progress` (the CLI passes stderr)."""
    combos = list(itertools.product(*params.values())) if params else [()]
    total = len(combos) * seeds
    rows: list[dict[str, Any]] = []
    metric = ""
    for number, (combo, seed) in enumerate(itertools.product(combos, range(seeds)), start=1):
        chosen = dict(zip(params, combo))
        config = with_params(scenario(name, peers, seed), {**(fixed or {}), **chosen})
        result = run(config)
        metric = result.main_metric
        row = {**chosen, "seed": seed, **{k: v for k, v in result.summary.items() if _scalar(v)}}
        rows.append(row)
        if progress is not None:
            shown = ", ".join(f"{k}={v}" for k, v in chosen.items()) or "base"
            print(f"[{number}/{total}] {name} {shown} seed={seed}: {metric}={row.get(metric)} "
                  f"({result.summary.get('wall_s', 0):.1f}s wall)", file=progress, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "sweep.csv", rows)
    (out_dir / "sweep.json").write_text(json.dumps({"scenario": name, "params": params, "seeds": seeds,
                                                    "runs": rows}, indent=2, allow_nan=False) + "\n")
    if params:
        plot_sweep(rows, list(params), metric, out_dir / "sweep.png", title=name)
    return rows


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool)) and not (
        isinstance(value, float) and not math.isfinite(value))


def plot_sweep(rows: list[dict[str, Any]], names: list[str], metric: str, path: Path, title: str) -> None:
    """`metric` (mean over seeds, min-max bars) against the first parameter, a line per value of
    the second."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    first, rest = names[0], names[1] if len(names) > 1 else None
    series: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        if row.get(metric) is None:
            continue
        label = f"{rest}={row[rest]}" if rest else metric
        series.setdefault(label, {}).setdefault(row[first], []).append(float(row[metric]))
    for label, points in series.items():
        xs = list(points)
        means = [sum(points[x]) / len(points[x]) for x in xs]
        low = [m - min(points[x]) for m, x in zip(means, xs)]
        high = [max(points[x]) - m for m, x in zip(means, xs)]
        ax.errorbar([_number(x) for x in xs], means, yerr=[low, high], marker="o", capsize=3, label=label)
    ax.set_xlabel(first)
    ax.set_ylabel(metric)
    ax.set_title(f"sweep: {title}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    save(fig, path)


def _number(text: Any) -> Any:
    try:
        return float(text)
    except (TypeError, ValueError):
        return text

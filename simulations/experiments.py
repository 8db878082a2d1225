"""The shipped experiments: their runs, tables and plots, and docs/experiments.md.

    python -m simulations.experiments --out docs            # about 4-5 minutes on 2 cores
    python -m simulations.experiments --out /tmp/x --quick  # N <= 1,000 and fewer points, ~1 min

Each `exp_*` function runs one experiment through `simulations.run.run_scenario` (so every
number comes from the real cores in the simulator), saves its plot under `<out>/img/` and
returns a markdown section; `main` writes them, with a header, to `<out>/experiments.md`.
Points use one or two seeds (said in each section) to keep the whole run within minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

from simulations.closed_form import (catch_probability, chain_time_s, expected_accepted_forgeries, star_time_s,
                                     tree_time_s)
from simulations.models import GBIT, Churn
from simulations.run import pyplot, run_scenario, save
from simulations.scenarios import (AuditScenario, BroadcastScenario, InferenceWaitScenario, broadcast, chain,
                                   kary_tree)

COMMAND = "python -m simulations.experiments --out docs"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# -- 1. time to all against N ------------------------------------------------------------------


def exp_time_to_all(img: Path, quick: bool) -> str:
    sizes = [10, 30, 100, 300, 1000] + ([] if quick else [3000, 10_000])
    strategies = ("relay", "tree4", "star")
    base = dataclasses.replace(broadcast(), checkpoint_bytes=1_000_000_000, chunk_bytes=16 * 2**20,
                               announce_interval_s=3600.0)
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for n in sizes:
        for strategy in strategies:
            # the star baseline runs without stall detection: with it, relays queued behind the origin
            # give up on it and find holders, which is no longer a star (and costs O(N) per give-up)
            stall = 1e6 if strategy == "star" else base.stall_timeout_s
            s = run_scenario(dataclasses.replace(base, peers=n, strategy=strategy, seed=1,
                                                 stall_timeout_s=stall)).summary
            results[(strategy, n)] = s
            _log(f"time-to-all: {strategy} N={n}: {s['time_to_all_s']:.2f}s (bound {s['lower_bound_s']:.2f}s, "
                 f"{s['wall_s']:.1f}s wall)")
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy, marker in zip(strategies, "osd"):
        ax.plot(sizes, [results[(strategy, n)]["time_to_all_s"] for n in sizes], marker=marker, label=strategy)
        bx.plot(sizes, [results[(strategy, n)]["ratio"] for n in sizes], marker=marker, label=strategy)
    ax.plot(sizes, [results[("relay", n)]["lower_bound_s"] for n in sizes], "k--", label="lower bound")
    for axis in (ax, bx):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("relays N")
        axis.grid(alpha=0.3, which="both")
        axis.legend()
    ax.set_ylabel("time to all (s)")
    bx.set_ylabel("time to all / lower bound")
    fig.suptitle("1 GB checkpoint, 16 MiB chunks, uploads log-uniform 0.1-10 Gbit/s, origin 10 Gbit/s")
    save(fig, img / "sim_time_to_all.png")
    worst = max(results[("relay", n)]["ratio"] for n in sizes)
    rows = []
    for n in sizes:
        r, t, s = (results[(x, n)] for x in strategies)
        rows.append([n, r["lower_bound_s"], r["time_to_all_s"], r["ratio"], t["time_to_all_s"], t["ratio"],
                     s["time_to_all_s"], star_time_s(n, base.checkpoint_bytes, base.origin_upload_bps),
                     sum(results[(x, n)]["wall_s"] for x in strategies)])
    return "\n".join([
        "## 1. Time to all against N",
        "",
        "One 1 GB checkpoint (16 MiB chunks, 60 chunks) from an origin uploading 10 Gbit/s to N relays whose "
        "uploads are log-uniform between 100 Mbit/s and 10 Gbit/s, downloads unlimited, relays spread over "
        "US/EU/Asia (40-110 ms one way). Same transfer core and bandwidth model for all three layouts; only the "
        "plan differs: `relay` (16 striped capacity-weighted trees), `tree4` (one pipelined tree of fan-out 4, "
        "shardcast-like), `star` (everyone pulls from the origin). One seed per point.",
        "",
        "![time to all](img/sim_time_to_all.png)",
        "",
        _table(["N", "lower bound s", "relay s", "relay/bound", "tree4 s", "tree4/bound", "star s",
                "star closed form N*S/U s", "wall s (3 runs)"], rows),
        "",
        f"The relay stays within {worst:.2f}x of the lower bound up to N = {sizes[-1]:,}; its excess grows slowly "
        "with N: it is the pipelining term (tree depth times a chunk time, with only a few chunks per stripe at "
        "16 MiB) plus cross-region latency per request. The single tree of fan-out 4 is 2.4-2.8x the bound at "
        "every size, because interior relays upload 4 copies and leaves none; the star grows linearly with N "
        "and matches N*S/U_origin (it runs without stall detection, see the code).",
    ])


# -- 2. the cost of churn and of byzantine relays ---------------------------------------------------


def exp_churn_byzantine(img: Path, quick: bool) -> str:
    n = 300 if quick else 500
    seeds = (0, 1)
    base = dataclasses.replace(broadcast(), peers=n, checkpoint_bytes=1_000_000_000, chunk_bytes=8 * 2**20,
                               announce_interval_s=5.0, stall_timeout_s=10.0)

    def mean_of(configs: list[BroadcastScenario]) -> dict[str, float]:
        runs = [run_scenario(c).summary for c in configs]
        keys = ("time_to_all_s", "mean_completion_s", "lower_bound_s", "bytes_moved_over_needed", "wall_s")
        out = {k: sum(r[k] for r in runs) / len(runs) for k in keys}
        out["right"] = sum(r["survivors_right_checkpoint"] for r in runs)
        out["survivors"] = sum(r["survivors"] for r in runs)
        out["joiners_right"] = sum(r["joiners_right_checkpoint"] for r in runs)
        out["joined"] = sum(r["joined"] for r in runs)
        out["honest_penalised"] = sum(r["honest_penalised"] for r in runs)
        out["byzantine_penalised"] = sum(r["byzantine_penalised"] for r in runs)
        out["byzantine"] = sum(r["byzantine"] for r in runs)
        return out

    churn_levels = [0.0, 0.1, 0.2, 0.3]
    churn_rows, churn_times = [], []
    for level in churn_levels:
        churn = Churn(departures=level, joins=level / 2, end_s=3.0)
        m = mean_of([dataclasses.replace(base, churn=churn, seed=s) for s in seeds])
        churn_times.append(m)
        churn_rows.append([level, level / 2, m["time_to_all_s"], m["mean_completion_s"], m["bytes_moved_over_needed"],
                           f"{m['right']}/{m['survivors']}", f"{m['joiners_right']}/{m['joined']}"])
        _log(f"churn {level}: {m['time_to_all_s']:.2f}s")
    kinds_rows, kinds = [], []
    for label, shares in (("crash", (0.0, 1.0, 0.0)), ("leave", (1.0, 0.0, 0.0)), ("hang", (0.0, 0.0, 1.0))):
        churn = Churn(departures=0.1, end_s=3.0, leave_share=shares[0], crash_share=shares[1], hang_share=shares[2])
        m = mean_of([dataclasses.replace(base, churn=churn, seed=s) for s in seeds])
        kinds_rows.append([label, m["time_to_all_s"], m["mean_completion_s"], f"{m['right']}/{m['survivors']}"])
        kinds.append(m["time_to_all_s"])
        _log(f"churn kind {label}: {m['time_to_all_s']:.2f}s")
    byz_levels = [0.0, 0.05, 0.1, 0.2, 0.3]
    byz_rows, byz_times = [], []
    for share in byz_levels:
        m = mean_of([dataclasses.replace(base, byzantine=share, forge=share > 0, seed=s) for s in seeds])
        byz_times.append(m)
        byz_rows.append([share, m["time_to_all_s"], m["mean_completion_s"], m["bytes_moved_over_needed"],
                         f"{m['right']}/{m['survivors']}", f"{m['byzantine_penalised']}/{m['byzantine']}",
                         m["honest_penalised"]])
        _log(f"byzantine {share}: {m['time_to_all_s']:.2f}s")
    every = churn_times + byz_times
    if all(m["right"] == m["survivors"] and m["joiners_right"] == m["joined"] for m in every):
        integrity = ("Every surviving honest relay and every joiner ends with the genuine manifest and every chunk "
                     "in every run; forged manifests are rejected by signature. ")
    else:
        integrity = "**Some surviving honest relays did not end with the genuine checkpoint (see the tables).** "
    if all(m["honest_penalised"] == 0 for m in every):
        integrity += "Only byzantine relays are ever penalised."
    else:
        integrity += "**Some honest relays were penalised.**"
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    ax.plot(churn_levels, [m["time_to_all_s"] for m in churn_times], "o-", label="time to all survivors")
    ax.plot(churn_levels, [m["mean_completion_s"] for m in churn_times], "s-", label="mean completion")
    ax.axhline(churn_times[0]["lower_bound_s"], color="k", linestyle="--", label="lower bound (no churn)")
    ax.set_xlabel("share of relays departing during the broadcast (joins: half that)")
    bx.plot(byz_levels, [m["time_to_all_s"] for m in byz_times], "o-", label="time to all honest")
    bx.plot(byz_levels, [m["mean_completion_s"] for m in byz_times], "s-", label="mean completion")
    bx.axhline(byz_times[0]["lower_bound_s"], color="k", linestyle="--", label="lower bound")
    bx.set_xlabel("share of byzantine relays (every chunk they serve is corrupt)")
    for axis in (ax, bx):
        axis.set_ylabel("seconds")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(f"{n} relays, 1 GB in 8 MiB chunks, mean of {len(seeds)} seeds")
    save(fig, img / "sim_churn_byzantine.png")
    return "\n".join([
        "## 2. The cost of churn and of byzantine relays",
        "",
        f"{n} relays (as in section 1, 8 MiB chunks), mean of seeds {seeds}. Churn: departures drawn uniformly "
        "in the first 3 s (half clean leaves, 40% crashes, 10% hangs) and half as many joins; the others notice "
        "10 s later (peer-table expiry) and replan. Byzantine relays serve only corrupt chunks, gossip a "
        "manifest signed with their own key and claim to hold the genuine version. A stalled source is "
        "dropped after 10 s.",
        "",
        "![churn and byzantine](img/sim_churn_byzantine.png)",
        "",
        _table(["departures", "joins", "time to all s", "mean completion s", "bytes moved / needed",
                "survivors with the right checkpoint", "joiners with it"], churn_rows),
        "",
        "Counts of relays are summed over both seeds. By kind of departure (10% of relays, no joins):",
        "",
        _table(["departure", "time to all s", "mean completion s", "survivors with the right checkpoint"],
               kinds_rows),
        "",
        _table(["byzantine share", "time to all honest s", "mean completion s", "bytes moved / needed",
                "honest with the right checkpoint", "byzantine penalised", "honest penalised"], byz_rows),
        "",
        integrity + f" The cost in time is large, though: 10% crashes or clean leaves take the time to all from "
        f"{churn_times[0]['time_to_all_s']:.1f} s to {kinds[0]:.1f} s, and hangs to {kinds[2]:.1f} s (a hang "
        f"is seen only by stall detection, 10 s). When an interior relay crashes or is banned, its orphans "
        f"borrow a live interior member of the same stripe at once (relay/transfer.py, 'Reattaching "
        f"orphans') instead of walking up to the origin, so the origin is not turned into a star. A "
        f"stalled parent is still replaced by its ancestors, because a substitute may be cut off too; each "
        f"hang costs a stall timeout, and each corrupt chunk a full chunk time before its hash check fails.",
    ])


# -- 3. catching cheaters ------------------------------------------------------------------------------


def exp_audit(img: Path, quick: bool) -> str:
    rates = [0.02, 0.05, 0.1, 0.2, 0.5, 1.0] if not quick else [0.05, 0.2, 1.0]
    cheaters = 100 if quick else 300
    base = AuditScenario(cheaters=cheaters, honest=10, submissions=12, validators=8)
    runs, worst_z = {}, 0.0
    for point, (detection, rate) in enumerate((d, r) for d in (1.0, 0.5) for r in rates):
        # a seed per point: with one seed, every point would share the same submissions and tickets
        config = dataclasses.replace(base, sample_rate=rate, detection_rate=detection, seed=100 + point)
        s = run_scenario(config).summary
        s["max_z"] = max((abs(a - b) / math.sqrt(b * (1 - b) / cheaters) for a, b in
                          zip(s["p_caught_within_k"], s["p_caught_within_k_closed_form"]) if 0 < b < 1), default=0.0)
        worst_z = max(worst_z, s["max_z"])
        runs[(detection, rate)] = s
        _log(f"audit detection {detection} rate {rate}: caught within 12 {s['p_caught_within_k'][-1]:.3f} "
             f"(closed form {s['p_caught_within_k_closed_form'][-1]:.3f})")
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    fine = [r / 100 for r in range(1, 101)]
    for detection, colour in ((1.0, "C0"), (0.5, "C1")):
        for k, style, marker in ((1, ":", "v"), (4, "--", "s"), (12, "-", "o")):
            ax.plot(fine, [catch_probability(r, detection, k) for r in fine], style, color=colour, linewidth=1)
            ax.plot(rates, [runs[(detection, r)]["p_caught_within_k"][k - 1] for r in rates], marker, color=colour,
                    markersize=4, label=f"d={detection}, k={k}")
        bx.plot(fine, [expected_accepted_forgeries(r, detection, 12) for r in fine], "-", color=colour, linewidth=1)
        bx.plot(rates, [runs[(detection, r)]["cheater_expected_gain"] for r in rates], "o", color=colour,
                label=f"detection {detection}")
    ax.set_xscale("log")
    ax.set_xlabel("validator sample rate p")
    ax.set_ylabel("P(caught within k forged submissions)")
    ax.legend(fontsize=7)
    bx.set_xscale("log")
    bx.set_xlabel("validator sample rate p")
    bx.set_ylabel("forged batches accepted (of 12), ban after 1 failure")
    bx.legend()
    for axis in (ax, bx):
        axis.grid(alpha=0.3, which="both")
    fig.suptitle(f"{cheaters} cheaters, 8 validators: markers simulated, lines closed form (1-(1-p*d)^k)")
    save(fig, img / "sim_audit.png")
    def gain(rate: float) -> float:
        return runs[(1.0, rate)]["cheater_expected_gain"]

    rows = []
    for detection in (1.0, 0.5):
        for rate in rates:
            s = runs[(detection, rate)]
            rows.append([detection, rate, s["p_caught_within_k"][0], s["p_caught_within_k_closed_form"][0],
                         s["p_caught_within_k"][3], s["p_caught_within_k_closed_form"][3],
                         s["p_caught_within_k"][-1], s["p_caught_within_k_closed_form"][-1],
                         s["p_caught_max_abs_error"], s["max_z"],
                         s["cheater_expected_gain"], s["cheater_expected_gain_closed_form"], s["checks_per_submission"],
                         s["honest_banned"]])
    return "\n".join([
        "## 3. Catching cheaters: sample rate against 1-(1-p)^k",
        "",
        f"8 validators, each running the real peer table and `ValidatorCore` (tickets, claims, verdicts, "
        f"reputation), {cheaters} workers forging every proof and 10 honest ones, 12 submissions each, "
        "one seed per point. The checker is a stub that detects a forged submission with probability d (its recall). "
        "A worker is banned after its first failed batch. Closed forms (`simulations.closed_form`): "
        "P(caught within k) = 1-(1-p*d)^k; expected forged batches accepted (unchecked, or checked and missed, "
        "before the ban) from the same per-submission probability.",
        "",
        "![audit](img/sim_audit.png)",
        "",
        _table(["d", "p", "P(k=1) sim", "closed", "P(k=4) sim", "closed", "P(k=12) sim", "closed",
                "max abs error (k=1..12)", "max error / SE", "accepted forgeries sim", "closed",
                "checks per submission", "honest banned"], rows),
        "",
        f"The simulated probabilities follow 1-(1-p*d)^k: the largest deviation over all points and k is "
        f"{worst_z:.1f} standard errors of a {cheaters}-cheater sample (the 12 values of k of one point are "
        "correlated, being the same cheaters). Claims keep the work at about one check per sampled "
        "submission (checks per admitted submission is close to p), and no honest worker is ever banned. "
        "The cheater's gain is what the closed form says: with a ban at the first failure, forged batches "
        f"accepted out of 12 fall from {gain(rates[0]):.1f} at p = {rates[0]:g} to {gain(rates[-2]):.1f} at "
        f"p = {rates[-2]:g} (d = 1); halving the checker's recall d is worth halving p.",
    ])


# -- 4. how long inference waits for weights --------------------------------------------------------


def exp_inference_wait(img: Path, quick: bool) -> str:
    gbits = [0.1, 0.3, 1.0, 3.0, 10.0]
    levels = [0, 1, 2, 4]
    base = InferenceWaitScenario(peers=50 if quick else 100, checkpoint_bytes=8_000_000_000, chunk_bytes=32 * 2**20)
    grid: dict[tuple[float, int], dict[str, Any]] = {}
    for g in gbits:
        for a in levels:
            grid[(g, a)] = run_scenario(dataclasses.replace(base, upload_bps=g * GBIT, async_level=a)).summary
        _log(f"inference wait {g} Gbit/s: broadcast {grid[(g, 0)]['broadcast_time_to_all_s']:.1f}s")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for a in levels:
        ax.plot(gbits, [grid[(g, a)]["inference_wait_mean_s"] for g in gbits], "o-", label=f"async_level {a}")
    ax.plot(gbits, [grid[(g, 0)]["broadcast_mean_s"] for g in gbits], "k--", label="broadcast time (mean)")
    ax.set_xscale("log")
    ax.set_xlabel("upload per relay (Gbit/s)")
    ax.set_ylabel("inference wait per step (s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    ax.set_title(f"8 GB checkpoint to {base.peers} workers; train {base.train_step_s:g} s, "
                 f"generate {base.generate_s:g} s per step")
    save(fig, img / "sim_inference_wait.png")
    rows = []
    for g in gbits:
        row: list[Any] = [g, grid[(g, 0)]["broadcast_time_to_all_s"], grid[(g, 0)]["broadcast_lower_bound_s"]]
        for a in levels:
            row += [grid[(g, a)]["inference_wait_mean_s"], grid[(g, a)]["step_period_s"]]
        rows.append(row)
    header = ["Gbit/s", "broadcast s", "bound s"]
    for a in levels:
        header += [f"wait a={a}", f"step a={a}"]
    return "\n".join([
        "## 4. How long inference waits for weights",
        "",
        f"An 8 GB checkpoint (32 MiB chunks) goes to {base.peers} inference workers, all uploading the given "
        "rate, origin 10 Gbit/s; the simulator gives each worker's arrival time D_p. The RL loop "
        f"(`simulations.inference_wait`): the trainer takes {base.train_step_s:g} s per step, each worker "
        f"{base.generate_s:g} s to generate a step's rollouts with weights at most `async_level` versions old "
        "(PRIME-RL's rule), and the trainer needs every worker's rollouts. Wait = time a worker idles "
        "before a step for lack of recent enough weights (steady state), step = seconds per trainer step.",
        "",
        "![inference wait](img/sim_inference_wait.png)",
        "",
        _table(header, rows),
        "",
        "In steady state the loop runs one step every T = max(max(generate, train), (D + generate + train) / "
        "(async_level + 1)) seconds, D being the slowest worker's broadcast time, and inference waits T - generate "
        "per step: synchronous training (async 0) waits for a train step plus a broadcast every step, and an "
        "async level a hides the broadcast completely while D <= (a + 1) max(generate, train) - generate - train "
        "(30 s for a = 1, 120 s for a = 2, 300 s for a = 4 here). The default async level 2 hides an 8 GB "
        "broadcast from about 1 Gbit/s per relay up.",
    ])


# -- 5. validation against closed forms ----------------------------------------------------------------------


def exp_validation(img: Path, quick: bool) -> str:
    cases = [("chain", chain(10)), ("chain", chain(40)), ("tree k=2", kary_tree(62, fanout=2)),
             ("tree k=3", kary_tree(120, fanout=3)), ("tree k=4", kary_tree(84, fanout=4))]
    rows = []
    for label, sc in cases:
        s = run_scenario(sc).summary
        fanout = 1 if sc.strategy == "chain" else sc.tree_fanout
        closed = (chain_time_s(sc.peers, s["chunks"], s["chunk_bytes"], sc.upload.low_bps, sc.local_latency_s)
                  if fanout == 1 else
                  tree_time_s(sc.peers, s["chunks"], s["chunk_bytes"], sc.upload.low_bps, fanout, sc.local_latency_s))
        rows.append([label, sc.peers, s["chunks"], s["time_to_all_s"], closed,
                     f"{100 * (s['time_to_all_s'] / closed - 1):+.3f}%"])
    return "\n".join([
        "## 5. Validation: pipelined chain and k-ary tree against their closed forms",
        "",
        "Equal 1 Gbit/s links, 64 chunks of 16 MiB, one request in flight per link, 0.5 ms latency. "
        "Closed forms (`simulations.closed_form`): T_chain = N*c/U + (m-1)*(c/U + l) + l and "
        "T_tree = d*k*c/U + (m-1)*(k*c/U + l) + l for depth d. The tests require agreement within 5%.",
        "",
        _table(["layout", "N", "chunks m", "simulated s", "closed form s", "difference"], rows),
    ])


EXPERIMENTS: list[tuple[str, Callable[[Path, bool], str]]] = [
    ("time_to_all", exp_time_to_all), ("churn_byzantine", exp_churn_byzantine), ("audit", exp_audit),
    ("inference_wait", exp_inference_wait), ("validation", exp_validation)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the simulator experiments and write experiments.md + plots.")
    parser.add_argument("--out", type=Path, required=True, help="directory for experiments.md and img/")
    parser.add_argument("--quick", action="store_true", help="N <= 1,000, fewer points (about a minute)")
    parser.add_argument("--only", action="append", choices=[name for name, _ in EXPERIMENTS],
                        help="run only these experiments (repeatable); experiments.md is not written")
    args = parser.parse_args(argv)
    img = args.out / "img"
    img.mkdir(parents=True, exist_ok=True)
    sections, timings = [], []
    for name, experiment in EXPERIMENTS:
        if args.only and name not in args.only:
            continue
        start, cpu = time.perf_counter(), time.process_time()
        sections.append(experiment(img, args.quick))
        timings.append(f"{name} {time.perf_counter() - start:.0f} s wall / {time.process_time() - cpu:.0f} s CPU")
        _log(f"== {timings[-1]}")
    if args.only:
        print("\n\n".join(sections))
        return 0
    header = "\n".join([
        "# Simulator experiments",
        "",
        "Every number below comes from the discrete-event simulator (`simulations/`) driving the real protocol "
        "cores (relay planner and transfer core, peer table, validator core, assignment and reputation) in "
        "virtual time; only links, clocks and the proof checker are modeled. Regenerate this page and its "
        f"plots with `{COMMAND}`{' --quick' if args.quick else ''} "
        f"(this run, on a shared 2-core machine: {', '.join(timings)}). Each scenario is also runnable alone: "
        "`p2pnet sim run SCENARIO --peers N --seed S --out DIR` (see `p2pnet sim list`), and any field can be "
        "swept: `p2pnet sim sweep churn --param churn.departures=0,0.1,0.2 --seeds 3 --out DIR`.",
    ])
    (args.out / "experiments.md").write_text(header + "\n\n" + "\n\n".join(sections) + "\n")
    print(f"wrote {args.out / 'experiments.md'} and {len(list(img.glob('sim_*.png')))} plots in {img}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A/B of the relay race: p2pnet alone under two settings, alternating, to tell a change from noise.

    flock /tmp/p2pnet-cpu.lock .venv/bin/python benchmarks/ab_relay_loopback.py --pairs 3 --runs 2 \\
        --b-extra $'[peertable]\\nheartbeat_interval_s = 10.0\\nexpiry_s = 50.0' --pause-page-reporting
    flock /tmp/p2pnet-cpu.lock .venv/bin/python benchmarks/ab_relay_loopback.py --a-tree /tmp/base

On a shared 2-core VM one p2pnet round of 1 GiB to 8 peers moves by 15% or more from one minute to
the next (BENCHMARKS.md), more than most single changes do, so a figure from one sitting compared
with another sitting's says nothing. This runs `bench_relay_loopback.py --only p2pnet --runs R`
for side A and side B in turn, `--pairs` times, the order flipped every pair (A B, then B A, ...)
so that a drift of the machine favours neither, and reports every round, each side's medians of
seconds and CPU-s, B over A, and in how many pairs B's mean was the lower.

A side is a tree and a relay config: `--a-tree`/`--b-tree` (default: this checkout) run that
tree's own `benchmarks/bench_relay_loopback.py` with the working directory and PYTHONPATH set to
the tree, so its peers run its code (make one with `git worktree add /tmp/base COMMIT`);
`--a-extra`/`--b-extra` go to BENCH_RELAY_EXTRA, TOML appended to every peer's config after its
`[relay]` section (it may open others, `[peertable]`, `[peer]`). `--json` keeps every round.
Hold the CPU locks the race's other users take, as above: a second CPU-heavy job makes both sides
lie.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path("benchmarks") / "bench_relay_loopback.py"


@dataclass(frozen=True)
class Side:
    name: str  # "A" or "B"
    tree: Path
    extra: str

    def describe(self) -> str:
        extra = self.extra.strip().replace("\n", "; ") or "no extra config"
        return f"{self.name}: {self.tree}, {extra}"

    def command(self, args: argparse.Namespace, json_path: Path) -> tuple[list[str], dict[str, str]]:
        """The race command for this side and its environment."""
        cmd = [sys.executable, str(self.tree / BENCH), "--only", "p2pnet", "--mib", str(args.mib),
               "--peers", str(args.peers), "--runs", str(args.runs), "--json", str(json_path)]
        if args.pause_page_reporting:
            cmd.append("--pause-page-reporting")
        env = dict(os.environ, PYTHONPATH=str(self.tree), BENCH_RELAY_EXTRA=self.extra)
        return cmd, env


Runner = Callable[[Side, argparse.Namespace], list[dict]]  # one sitting of a side: its p2pnet rounds


def run_side(side: Side, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="ab-relay-") as tmp:
        json_path = Path(tmp) / "rounds.json"
        cmd, env = side.command(args, json_path)
        done = subprocess.run(cmd, cwd=side.tree, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"side {side.name}'s race failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(json_path.read_text())["rounds"]["p2pnet"]


def order(pair: int, a: Side, b: Side) -> tuple[Side, Side]:
    """A then B in even pairs, B then A in odd ones."""
    return (a, b) if pair % 2 == 0 else (b, a)


def ab(a: Side, b: Side, args: argparse.Namespace, runner: Runner = run_side,
       say: Callable[[str], None] = print) -> dict:
    """Every pair's rounds and the summary; `say` gets a line per side's sitting as it ends."""
    pairs: list[dict[str, list[dict]]] = []
    for pair in range(args.pairs):
        rounds: dict[str, list[dict]] = {}
        for side in order(pair, a, b):
            rounds[side.name] = runner(side, args)
            say(f"pair {pair + 1} {side.name}: " + ", ".join(f"{r['seconds']:.2f} s / {r['cpu_s']:.1f} CPU-s"
                                                            for r in rounds[side.name]))
        pairs.append(rounds)
    return {"sides": {s.name: {"tree": str(s.tree), "extra": s.extra} for s in (a, b)}, "pairs": pairs,
            "summary": summary(pairs)}


def summary(pairs: list[dict[str, list[dict]]]) -> dict:
    def every(side: str, key: str) -> list[float]:
        return [r[key] for p in pairs for r in p[side]]

    def lower_in(key: str) -> int:  # pairs in which B's mean was the lower
        return sum(statistics.mean(r[key] for r in p["B"]) < statistics.mean(r[key] for r in p["A"]) for p in pairs)

    out: dict = {"pairs": len(pairs)}
    for key in ("seconds", "cpu_s"):
        med_a, med_b = statistics.median(every("A", key)), statistics.median(every("B", key))
        out[key] = {"A": med_a, "B": med_b, "B_over_A": med_b / med_a, "B_lower_in_pairs": lower_in(key)}
    return out


def report(result: dict, a: Side, b: Side) -> None:
    s = result["summary"]
    print(f"\n{a.describe()}\n{b.describe()}")
    for key, unit in (("seconds", "s"), ("cpu_s", "CPU-s")):
        m = s[key]
        print(f"{key:8} medians A {m['A']:.2f} {unit}, B {m['B']:.2f} {unit}: B/A {m['B_over_A']:.3f}; "
              f"B lower in {m['B_lower_in_pairs']} of {s['pairs']} pairs")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--pairs", type=int, default=3, help="sittings of each side (default 3)")
    parser.add_argument("--runs", type=int, default=2, help="rounds per sitting (default 2)")
    parser.add_argument("--mib", type=int, default=1024, help="checkpoint size in MiB (default 1024)")
    parser.add_argument("--peers", type=int, default=8, help="receiving peers (default 8)")
    parser.add_argument("--a-tree", type=Path, default=ROOT, help="side A's checkout (default: this one)")
    parser.add_argument("--b-tree", type=Path, default=ROOT, help="side B's checkout (default: this one)")
    parser.add_argument("--a-extra", default="", help="side A's BENCH_RELAY_EXTRA (TOML)")
    parser.add_argument("--b-extra", default="", help="side B's BENCH_RELAY_EXTRA (TOML)")
    parser.add_argument("--pause-page-reporting", action="store_true",
                        help="passed to the race (root; see bench_relay_loopback.py)")
    parser.add_argument("--json", type=Path, help="write every round and the summary here")
    args = parser.parse_args()
    if args.pairs < 1 or args.runs < 1:
        parser.error("--pairs and --runs must be at least 1")
    a, b = Side("A", args.a_tree.resolve(), args.a_extra), Side("B", args.b_tree.resolve(), args.b_extra)
    for side in (a, b):
        if not (side.tree / BENCH).is_file():
            parser.error(f"side {side.name}: {side.tree} has no {BENCH}")
    if (a.tree, a.extra) == (b.tree, b.extra):
        print("note: A and B are the same; this measures the race's noise", file=sys.stderr)
    result = ab(a, b, args)
    report(result, a, b)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

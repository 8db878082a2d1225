"""Benchmark of DiLoCo across trainer peers: learning, bytes, faults and round time.

Owns the DiLoCo figures in BENCHMARKS.md and docs/experiments.md and the plot docs/img/diloco.png.
On the tiny model and the fixed arithmetic task (`trainer.diloco_local`), with the same total
number of inner steps:

  1. learning, in one process (the same cores the peers run, the all-reduce delivered in memory):
     one trainer taking every step itself; DiLoCo with N peers and int8 pseudo-gradients; the
     same with fp32. The held-out loss against total inner steps, and the int8 error against fp32.
  2. bytes per peer per round: reduce-scatter + all-gather (as measured by the cores, int8 and
     fp32) against sending the whole vector to every other peer.
  3. faults, over the real network (`p2pnet devnet --trainers N` processes): one trainer killed
     (SIGKILL) at a random round and one started later; the loss still falls.
  4. round time of that run's all-reduces against the bandwidth lower bound 2 (N-1)/N x S / U,
     with U the measured throughput of one authenticated data-plane connection on loopback.

Must not: download anything. Heavy: run it under `flock /tmp/p2pnet-cpu.lock`.

The outer step is DiLoCo's (lr 0.7, momentum 0.9) unless --outer-lr/--outer-momentum say
otherwise; then DiLoCo's is run and drawn as well (`bench_diloco_outer.py` has the sweep).

Run: PYTHONPATH=. .venv/bin/python benchmarks/bench_diloco.py --peers 4 --rounds 30 --inner-steps 20 \\
         --net-rounds 30 --outer-lr 0.5 --outer-momentum 0.0 --json results.json --plot docs/img/diloco.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from models.tiny import build_model  # noqa: E402
from trainer.allreduce import AllReduce, AllReduceConfig, Finished, Send  # noqa: E402
from trainer.diloco import Encoding, OuterConfig, OuterOptimizer, Packed, pack, packed_bytes, unpack  # noqa: E402
from trainer.diloco_local import InnerConfig, InnerTrainer  # noqa: E402


def reduce_in_memory(vectors: dict[str, torch.Tensor], config: AllReduceConfig) -> tuple[torch.Tensor, int]:
    """The all-reduce cores of every peer, messages delivered in memory; (mean, most bytes any peer sent)."""
    members = tuple(sorted(vectors))
    cores = {p: AllReduce(p, 0, members, v, config) for p, v in vectors.items()}
    queue = [(p, e) for p, c in cores.items() for e in c.start(0.0)]
    done: dict[str, torch.Tensor] = {}
    while queue:
        origin, effect = queue.pop(0)
        if isinstance(effect, Send):
            queue += [(effect.peer, e) for e in cores[effect.peer].receive(0.0, origin, effect.body)]
        elif isinstance(effect, Finished):
            done[origin] = effect.mean
    assert len(done) == len(cores), "the in-memory all-reduce did not finish"
    return done[members[0]], max(c.bytes_sent for c in cores.values())


def _trainer(seed: int, args: argparse.Namespace) -> InnerTrainer:
    model, tok = build_model(args.model, seed=0)
    return InnerTrainer(model, tok, InnerConfig(lr=args.inner_lr, batch_size=args.batch_size), data_seed=seed)


def run_single(args: argparse.Namespace) -> list[tuple[int, float]]:
    """One trainer, every inner step itself: (total inner steps, held-out loss) per N x H steps."""
    t = _trainer(1, args)
    curve = [(0, t.eval_loss())]
    for r in range(args.rounds):
        t.train(args.peers * args.inner_steps)
        curve.append(((r + 1) * args.peers * args.inner_steps, t.eval_loss()))
    return curve


def run_diloco(args: argparse.Namespace, encoding: Encoding, outer_config: OuterConfig | None = None) -> dict[str, Any]:
    peers = {f"peer{i}": _trainer(100 + i, args) for i in range(args.peers)}
    global_weights = next(iter(peers.values())).weights()
    outer_config = outer_config or OuterConfig(args.outer_lr, args.outer_momentum)
    outer = OuterOptimizer(outer_config, global_weights.numel())
    config = AllReduceConfig(encoding=encoding)
    first = next(iter(peers.values()))
    curve = [(0, first.eval_loss(global_weights))]
    bytes_per_round, errors, rounds = [], [], []
    previous: torch.Tensor | None = None
    for r in range(args.rounds):
        pseudo = {}
        for name, t in peers.items():
            t.load(global_weights)
            t.train(args.inner_steps)
            pseudo[name] = global_weights - t.weights()
        mean, sent = reduce_in_memory(pseudo, config)
        exact = torch.stack(list(pseudo.values())).mean(0)
        errors.append(float((mean - exact).norm() / exact.norm()))
        bytes_per_round.append(sent)
        new_weights = outer.step(global_weights, mean)
        curve.append(((r + 1) * args.peers * args.inner_steps, first.eval_loss(new_weights)))
        update = float((global_weights - new_weights).norm())
        rounds.append({"round": r + 1, "loss": curve[-1][1], "mean_norm": float(mean.norm()),
                       "cos_previous": _cos(mean, previous) if previous is not None else float("nan"),
                       "peer_cos": sum(_cos(p, mean) for p in pseudo.values()) / len(pseudo),
                       "update_norm": update, "ratio": update / float(mean.norm())})
        global_weights, previous = new_weights, mean
    return {"curve": curve, "bytes_per_round": bytes_per_round, "relative_error": errors,
            "parameters": global_weights.numel(), "rounds": rounds}


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def measure_dataplane_bps(mib: int = 256) -> float:
    """Bytes/s of one authenticated data-plane connection on loopback (both ends in this process)."""
    import trio

    from p2pnet.dataplane import DataPlane, open_data_stream
    from p2pnet.identity import Identity
    from p2pnet.wire import Codec

    server_id, client_id = Identity.from_seed_text("bench-server"), Identity.from_seed_text("bench-client")
    total = mib << 20
    result = {}

    async def main() -> None:
        plane = DataPlane(codec=Codec(server_id), self_id=server_id.peer_id, admit=lambda peer: None)
        done = trio.Event()

        async def sink(stream, reader, peer) -> None:
            got = 0
            buffer = bytearray(1 << 20)
            while got < total:
                n = min(len(buffer), total - got)
                await reader.exactly_into(n, buffer)
                got += n
            done.set()

        plane.register("bench", sink)
        async with trio.open_nursery() as nursery:
            address = await nursery.start(plane.serve)
            stream = await open_data_stream(address, "bench", codec=Codec(client_id), peer=server_id.peer_id)
            block = bytes(1 << 20)
            started = time.perf_counter()
            for _ in range(mib):
                await stream.send_all(block)
            await done.wait()
            result["bps"] = total / (time.perf_counter() - started)
            await stream.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    return result["bps"]


def measure_cpu_per_round_s(params: int, n: int, repeats: int = 5) -> float:
    """CPU seconds one peer spends per round on the all-reduce's own work, no network: quantize its
    vector, sign and encode what it sends (2 (N-1)/N of it), decode, check and dequantize what it
    receives, and average one shard. The floor a loopback round cannot go under in this code."""
    from p2pnet.identity import Identity
    from p2pnet.wire import Codec

    vectors = {f"peer{i}": torch.randn(params) for i in range(n)}
    members = tuple(sorted(vectors))
    codec = Codec(Identity.from_seed_text("bench"))
    times = []
    for _ in range(repeats):
        started = time.process_time()
        core = AllReduce("peer0", 0, members, vectors["peer0"], AllReduceConfig())
        sends = [e for e in core.start(0.0) if isinstance(e, Send)]
        frames = [codec.encode(e.body, time.time()) for e in sends]
        for frame in frames:  # receiving as much as it sent, as every peer does
            part = codec.decode(frame, time.time()).body
            unpack(Packed(Encoding(part.encoding), part.length, part.block, part.values, part.scales))
        shard = core.shards[0]
        torch.stack([vectors[p][shard.start:shard.end] for p in members]).mean(0)
        times.append(time.process_time() - started)
    return statistics.median(times) * 2  # the reduce-scatter and the all-gather each move as much


def run_faults(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from trainer.devnet_diloco import DilocoDevnetConfig, run_diloco_devnet

    rng = random.Random(args.seed)
    kill_at = rng.randint(1, max(1, args.net_rounds // 3))
    join_at = min(args.net_rounds - 2, kill_at + 2)  # early enough to take part: a new process needs seconds
    config = DilocoDevnetConfig(trainers=args.peers, inner_steps=args.inner_steps, rounds=args.net_rounds,
                                relays=1, model=args.model, encoding="int8", inner_lr=args.inner_lr,
                                batch_size=args.batch_size, kill_at_round=kill_at, join_at_round=join_at,
                                deadline_s=args.deadline_s, outer_lr=args.outer_lr,
                                outer_momentum=args.outer_momentum)
    summary = run_diloco_devnet(config, root)
    return {"kill_at_round": kill_at, "join_at_round": join_at, **summary}


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4))
    outer = results["outer"]
    for key, label in (("single", "1 trainer"), ("int8", f"DiLoCo {results['peers']} peers, int8"),
                       ("fp32", f"DiLoCo {results['peers']} peers, fp32"),
                       ("int8_diloco_defaults", f"DiLoCo {results['peers']} peers, int8, outer lr 0.7 mom 0.9")):
        if key not in results:
            continue
        curve = results[key] if key == "single" else results[key]["curve"]
        left.plot([s for s, _ in curve], [loss for _, loss in curve], label=label, marker=".",
                  ls={"fp32": "--", "int8_diloco_defaults": ":"}.get(key, "-"))
    faults = results.get("faults")
    if faults:
        curve = fault_curve(faults, results["inner_steps"])
        left.plot([s for s, _ in curve], [loss for _, loss in curve], marker=".", color="black",
                  label=f"real peers, int8, one killed (round {faults['kill_at_round']}), one joins")
    left.set_xlabel("total inner steps (all peers)")
    left.set_ylabel("held-out loss")
    left.set_title(f"same total inner steps (outer lr {outer['lr']}, momentum {outer['momentum']})")
    left.legend()
    errors = results["int8"]["relative_error"]
    middle.semilogy(range(1, len(errors) + 1), errors, marker=".", label="int8 all-reduce vs exact fp32 mean")
    middle.axhline(results["int8_error_randn"], color="gray", ls=":", label="int8 round trip of N(0,1) values")
    middle.set_xlabel("round")
    middle.set_ylabel("relative L2 error")
    middle.set_title("int8 quantization error")
    middle.legend()
    if faults:
        rows = faults["rounds"]
        right.plot([r["round"] + 1 for r in rows], [r["loss"] for r in rows], marker=".", label="held-out loss")
        for event in faults["events"]:
            right.axvline(event["round"] + 0.5, color="red" if event["event"] == "killed" else "green", ls="--",
                          label=f"{event['peer']} {event['event']}")
        right.set_xlabel("round")
        right.set_title(f"real peers: one killed, one joins ({results['peers']} trainers, int8)")
        right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def fault_curve(faults: dict[str, Any], inner_steps: int) -> list[tuple[int, float]]:
    """(total inner steps taken by the contributors so far, held-out loss) per round of the real run."""
    curve, steps = [], 0
    for row in faults["rounds"]:
        steps += len(row["contributors"]) * inner_steps
        curve.append((steps, row["loss"]))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15, help="outer rounds of the in-process comparison")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov lr (DiLoCo's default 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (DiLoCo's 0.9)")
    parser.add_argument("--net-rounds", type=int, default=30, help="rounds of the real-network run (0: skip it)")
    parser.add_argument("--deadline-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--faults-only", action="store_true",
                        help="run only the real-network kill-and-join run (--net-rounds rounds) and report it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    results: dict[str, Any] = {"peers": args.peers, "rounds": args.rounds, "inner_steps": args.inner_steps,
                               "outer": {"lr": args.outer_lr, "momentum": args.outer_momentum}}
    if args.faults_only:
        with tempfile.TemporaryDirectory(prefix="bench-diloco-") as tmp:
            faults = run_faults(args, Path(tmp))
        if args.json:
            args.json.write_text(json.dumps({**results, "faults": faults}, indent=1))
        report_faults(faults, args.inner_steps)
        return
    started = time.monotonic()
    results["single"] = run_single(args)
    results["int8"] = run_diloco(args, Encoding.INT8)
    results["fp32"] = run_diloco(args, Encoding.FP32)
    if OuterConfig(args.outer_lr, args.outer_momentum) != OuterConfig():
        results["int8_diloco_defaults"] = run_diloco(args, Encoding.INT8, OuterConfig())
    n, params = args.peers, results["int8"]["parameters"]
    results["bytes"] = {
        "int8_measured": max(results["int8"]["bytes_per_round"]),
        "fp32_measured": max(results["fp32"]["bytes_per_round"]),
        "naive_all_to_all_int8": (n - 1) * packed_bytes(params, Encoding.INT8),
        "naive_all_to_all_fp32": (n - 1) * packed_bytes(params, Encoding.FP32),
    }
    vector = torch.randn(params)
    results["int8_error_randn"] = float((unpack(pack(vector, Encoding.INT8)) - vector).norm() / vector.norm())
    print(f"in-process part: {time.monotonic() - started:.0f} s", flush=True)
    results["dataplane_bps"] = measure_dataplane_bps()
    results["cpu_per_round_s"] = measure_cpu_per_round_s(params, n)
    if args.net_rounds:
        with tempfile.TemporaryDirectory(prefix="bench-diloco-") as tmp:
            results["faults"] = run_faults(args, Path(tmp))
        s_int8 = packed_bytes(params, Encoding.INT8)
        results["round_bound_s"] = 2 * (n - 1) / n * s_int8 / results["dataplane_bps"]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    report(results)
    if args.plot:
        _plot(results, args.plot)


def report(results: dict[str, Any]) -> None:
    single, int8, fp32 = results["single"], results["int8"], results["fp32"]
    outer = results["outer"]
    print(f"final held-out loss, {single[-1][0]} inner steps in all: 1 trainer {single[-1][1]:.4f}, "
          f"DiLoCo int8 {int8['curve'][-1][1]:.4f}, DiLoCo fp32 {fp32['curve'][-1][1]:.4f} "
          f"(outer lr {outer['lr']}, momentum {outer['momentum']}; start {single[0][1]:.4f})")
    if "int8_diloco_defaults" in results:
        curve = [loss for _, loss in results["int8_diloco_defaults"]["curve"]]
        print(f"DiLoCo int8 at DiLoCo's outer defaults (lr 0.7, momentum 0.9): final {curve[-1]:.4f}, "
              f"lowest {min(curve):.4f}, highest after round 10 {max(curve[10:]):.4f}")
    print(f"int8 all-reduce error vs exact mean (relative L2): median {statistics.median(int8['relative_error']):.2e}; "
          f"of a N(0,1) vector alone {results['int8_error_randn']:.2e}")
    b = results["bytes"]
    print(f"bytes per peer per round: int8 {b['int8_measured']}, fp32 {b['fp32_measured']} "
          f"(fp32/int8 {b['fp32_measured'] / b['int8_measured']:.2f}x), naive all-to-all int8 "
          f"{b['naive_all_to_all_int8']} ({b['naive_all_to_all_int8'] / b['int8_measured']:.2f}x more), "
          f"naive fp32 {b['naive_all_to_all_fp32']} ({b['naive_all_to_all_fp32'] / b['int8_measured']:.2f}x more)")
    print(f"data plane, one connection on loopback: {results['dataplane_bps'] / 1e6:.0f} MB/s")
    faults = results.get("faults")
    if faults:
        report_faults(faults, results["inner_steps"])
        times = [r["allreduce_s"] for r in faults["rounds"]]
        print(f"all-reduce time: median {statistics.median(times):.3f} s, lower bound 2(N-1)/N x S/U = "
              f"{results['round_bound_s'] * 1e3:.2f} ms (ratio {statistics.median(times) / results['round_bound_s']:.0f}x); "
              f"the all-reduce's own CPU work per peer per round {results['cpu_per_round_s'] * 1e3:.1f} ms "
              f"(ratio {statistics.median(times) / results['cpu_per_round_s']:.1f}x)")


def report_faults(faults: dict[str, Any], inner_steps: int) -> None:
    """The kill-and-join run: loss, contributors, and how the joiner got the global state."""
    rows = faults["rounds"]
    curve = fault_curve(faults, inner_steps)
    print(f"faults: killed at round {faults['kill_at_round']}, joined at {faults['join_at_round']}; loss "
          f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} over {len(rows)} rounds ({curve[-1][0]} inner steps), "
          f"highest after round 10 {max(r['loss'] for r in rows[10:]) if len(rows) > 10 else float('nan'):.4f}; "
          f"contributors per round {[len(r['contributors']) for r in rows]}")
    print("faults: loss per round " + " ".join(f"{r['loss']:.3f}" for r in rows))
    for event in faults.get("events", []):
        if event["event"] == "state_taken":
            print(f"faults: {event['peer']} took the global state of round {event['round']} from "
                  f"{event['from']} via {event['via']}")
        elif event["event"] == "outer_state_published":
            print(f"faults: {event['peer']} published version(s) {event['versions']} with the outer state, "
                  f"{event['bytes']} bytes more for every relay than a version without it")


if __name__ == "__main__":
    main()

"""Lab benchmark: one checkpoint from an origin to N peers on separate hosts over real, limited links.

    python benchmarks/bench_lab_relay.py --peers 16 --mib 128 --seed 1 [--layouts striped tree star]

Needs root (network namespaces; see `p2pnet.lab`). One lab for the whole run: an origin host
with `--origin-mbit` upload (100) and N peer hosts whose upload limits are drawn uniformly from
`--upload-mbit LOW HIGH` (25-200, seeded), download limits `--download-factor` (4) times the
upload, all as tbf on both ends of each host's link. Every peer is a real `p2pnet peer start
--role relay` process in its own host, listening on 0.0.0.0 and advertising its upload limit;
`--unadvertised origin` starts the origin without `--upload-bps`, so it advertises the default
(1 GB/s) on its capped link, as a trainer on a home uplink that never measured it, and
`--unadvertised all` every peer (`relay.judging`, `_sent_us_bps`: the row's
`origin_upload_copies` says what the origin served). With the origin alone unadvertised the plan
takes it for the fastest member by far and makes it every peer's parent in every stripe.

For each layout, in the same run, on the same lab and file: fresh peers are started, the run
waits until every peer knows every other and is dialled back (`reachable`), then the origin
publishes; time-to-all runs from the publish command until the last peer has every chunk
verified (the relays' own `complete_at_s`). Layouts: `striped` (p2pnet's relay), `tree` (one
pipelined tree of fan-out 4) and `star` (every peer pulls from the origin), the same relay
processes with `[relay] layout` changed.

Reported against the fluid lower bound max(S/U_origin, S/min(D), N*S/(U_origin + sum U)), and
next to the simulator's prediction for the same links (`simulations.broadcast` with these
uploads and downloads, the same chunk size and the same transfer core).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pnet.lab import HostSpec, Lab, LabSpec, lab_unavailable  # noqa: E402
from p2pnet.localnet import PeerProcess, control_call, peer_id_of, start_peer, wait_for  # noqa: E402

MBIT = 1e6 / 8


def make_checkpoint(path: Path, mib: int) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.random.default_rng(0).integers(0, 256, size=mib * 2**20, dtype=np.uint8)}, str(path))
    return path


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> dict[str, float]:
    """Machine-wide CPU seconds so far by kind (/proc/stat): where the lab's work goes."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:8]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq = (int(f) / tick for f in fields)
    return {"user": user + nice, "system": system, "softirq": softirq + irq, "idle": idle + iowait}


def lower_bound_s(size: int, origin_bps: float, uploads: list[float], downloads: list[float]) -> float:
    n = len(uploads)
    return max(size / origin_bps, size / min(downloads), n * size / (origin_bps + sum(uploads)))


def simulate(layout: str, size: int, chunk_bytes: int, origin_bps: float, uploads: list[float],
             downloads: list[float]) -> float:
    from relay.transfer import TransferConfig
    from simulations.broadcast import build_broadcast, run_broadcast_sim

    strategy = {"striped": "relay", "tree": "tree4", "star": "star"}[layout]
    ups, downs = iter(uploads), iter(downloads)
    config = TransferConfig(stall_timeout_s=30.0, exclude_s=60.0, announce_interval_s=1.0, max_in_flight=16)
    sim = build_broadcast(len(uploads), size, upload_bps=lambda rng: next(ups), origin_upload_bps=origin_bps,
                          download_bps=lambda rng: next(downs), strategy=strategy, chunk_bytes=chunk_bytes,
                          latency_s=0.0002, config=config, pace_uploads=True)
    return run_broadcast_sim(sim, strategy=strategy).time_to_all_s


def run_layout(lab: Lab, layout: str, root: Path, source: Path, args: argparse.Namespace,
               uploads: dict[str, float]) -> dict:
    root.mkdir(parents=True)
    origin_id = peer_id_of(root / "origin")
    config = root / "relay.toml"
    config.write_text(f'[relay]\ntrusted_publishers = ["{origin_id}"]\nchunk_bytes = {args.chunk_kib * 1024}\n'
                      f'layout = "{layout}"\nfsync = false\nannounce_interval_s = {args.heartbeat_s}\n'
                      f'stall_timeout_s = 30.0\n[peertable]\nheartbeat_interval_s = {args.heartbeat_s}\n'
                      f'expiry_s = {4 * args.heartbeat_s}\n')
    peers: list[PeerProcess] = []

    def start(name: str, bootstrap: list[str]) -> PeerProcess:
        peer = start_peer(name, root / name, roles=["relay"], bootstrap=bootstrap, wrap=lab.wrap(name),
                          extra_args=["--listen", "/ip4/0.0.0.0/tcp/0", "--config", str(config),
                                      *([] if args.unadvertised == "all" or args.unadvertised == name
                                        else ["--upload-bps", str(int(uploads[name]))])])
        peers.append(peer)
        return peer

    try:
        origin = start("origin", [])
        origin.wait_ready(60)
        for name in uploads:
            if name != "origin":
                start(name, [origin.addr])
        for peer in peers:
            peer.wait_ready(120)
        ids = {p.peer_id for p in peers}
        for peer in peers:
            wait_for(lambda: (s := peer.status()) and s["reachable"] is True
                     and {e["peer_id"] for e in s["peers"] if e["reachable"]} == ids - {peer.peer_id},
                     180, f"{peer.name} knows every peer as reachable", poll_s=1.0)
        time.sleep(3.0)  # one more membership refresh everywhere (the relays poll it every second)
        pids = [p.proc.pid for p in peers]
        idle_cpu = cpu_seconds(pids)
        time.sleep(args.heartbeat_s * 2)
        idle_cores = (cpu_seconds(pids) - idle_cpu) / (args.heartbeat_s * 2)  # gossip and heartbeats alone
        cpu_before, machine_before = cpu_seconds(pids), machine_cpu()
        started = time.time()
        control_call(origin.data_dir, {"cmd": "checkpoint.publish", "paths": [str(source)], "model": "bench",
                                       "version": 1, "chunk_bytes": args.chunk_kib * 1024}, timeout_s=300)
        published = time.time()
        receivers = [p for p in peers if p.name != "origin"]
        wait_for(lambda: all("version 1 complete" in p.log_path.read_text() for p in receivers),
                 args.timeout_s, f"{layout}: every peer completes", poll_s=0.5)
        cpu_s = cpu_seconds(pids) - cpu_before
        busy_s = time.time() - started
        machine = {k: round((v - machine_before[k]) / busy_s, 2) for k, v in machine_cpu().items()}
        done = {p.name: p.status()["role_status"]["relay"]["timeline"]["1"]["complete_at_s"] for p in receivers}
        origin_served = origin.status()["role_status"]["relay"]["bytes_served"]
    finally:
        for peer in peers:
            peer.stop(timeout_s=20)
    return {"layout": layout, "time_to_all_s": max(done.values()) - started, "publish_s": published - started,
            "first_s": min(done.values()) - started, "origin_upload_copies": origin_served / source.stat().st_size,
            "peers_cpu_s": cpu_s, "peers_cores_busy": cpu_s / busy_s, "idle_cores_busy": idle_cores,
            "machine_cores": machine}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--origin-mbit", type=float, default=100.0)
    parser.add_argument("--unadvertised", choices=["none", "origin", "all"], default="none",
                        help="start these peers without --upload-bps: links capped, the default advertised")
    parser.add_argument("--upload-mbit", type=float, nargs=2, default=(25.0, 200.0))
    parser.add_argument("--download-factor", type=float, default=4.0)
    parser.add_argument("--chunk-kib", type=int, default=1024)
    parser.add_argument("--layouts", nargs="+", default=["striped", "tree", "star"])
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--mtu", type=int, default=9000,
                        help="link MTU in the lab (default 9000: a sixth of the packets per byte of 1500)")
    parser.add_argument("--heartbeat-s", type=float, default=15.0,
                        help="heartbeat and Holding interval: gossip costs ~10 ms CPU per message per peer")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    reason = lab_unavailable()
    if reason:
        print(reason)
        return 2
    rng = random.Random(args.seed)
    up_mbit = {f"p{i}": round(rng.uniform(*args.upload_mbit), 1) for i in range(args.peers)}
    hosts = [HostSpec("origin", args.origin_mbit, args.origin_mbit * args.download_factor)]
    hosts += [HostSpec(name, up, up * args.download_factor) for name, up in up_mbit.items()]
    uploads = {"origin": args.origin_mbit * MBIT, **{n: u * MBIT for n, u in up_mbit.items()}}
    downloads = [u * args.download_factor * MBIT for n, u in up_mbit.items()]
    peer_uploads = [uploads[n] for n in up_mbit]
    results = []
    with tempfile.TemporaryDirectory(prefix="p2pnet-labbench-") as tmp:
        root = Path(tmp)
        source = make_checkpoint(root / "model.safetensors", args.mib)
        size = source.stat().st_size
        bound = lower_bound_s(size, uploads["origin"], peer_uploads, downloads)
        print(f"{args.peers} peers, uploads {min(up_mbit.values())}-{max(up_mbit.values())} Mbit/s "
              f"(sum {sum(up_mbit.values()):.0f}), origin {args.origin_mbit} Mbit/s, checkpoint {size / 2**20:.1f} MiB, "
              f"chunks {args.chunk_kib} KiB, MTU {args.mtu}, heartbeats every {args.heartbeat_s}s; lower bound {bound:.2f}s", flush=True)
        with Lab.up(LabSpec(tuple(hosts), f"b{secrets.token_hex(3)}", mtu=args.mtu), root / "lab") as lab:
            for layout in args.layouts:
                row = run_layout(lab, layout, root / layout, source, args, uploads)
                wall = time.perf_counter()
                row["simulated_s"] = simulate(layout, size, args.chunk_kib * 1024, uploads["origin"], peer_uploads,
                                              downloads)
                row["sim_wall_s"] = time.perf_counter() - wall
                row["bound_s"] = bound
                row["ratio_to_bound"] = row["time_to_all_s"] / bound
                row["sim_error"] = row["simulated_s"] / row["time_to_all_s"] - 1
                results.append(row)
                print(f"{layout:8} time-to-all {row['time_to_all_s']:7.2f}s  {row['ratio_to_bound']:5.2f}x bound  "
                      f"simulated {row['simulated_s']:7.2f}s ({row['sim_error']:+.0%})  "
                      f"origin uploaded {row['origin_upload_copies']:.2f} copies  peers used "
                      f"{row['peers_cores_busy']:.2f} cores ({row['idle_cores_busy']:.2f} idle); machine "
                      + " ".join(f"{k} {v:.2f}" for k, v in row["machine_cores"].items()), flush=True)
    by = {r["layout"]: r for r in results}
    if "striped" in by:
        for other in ("star", "tree"):
            if other in by:
                print(f"striped is {by[other]['time_to_all_s'] / by['striped']['time_to_all_s']:.2f}x faster "
                      f"than {other}")
    if args.json:
        args.json.write_text(json.dumps({"bound_s": bound, "uploads_mbit": up_mbit, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

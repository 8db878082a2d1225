"""Under attack: a version published to relays while a stranger floods every relay's data plane.

    sudo .venv/bin/python benchmarks/bench_under_attack.py --relays 8 --mib 256 --per-relay 1000

Needs root (the network lab, `p2pnet.lab`): one host per relay (the first publishes) and one
attacker host, every link limited to `--link-mbit`. Two runs in one invocation, each with fresh
relay processes: without attack, then with the attacker holding `--per-relay` connections open to
each relay's data plane for the whole transfer, a quarter each of: idle (connect, say nothing),
half frames (two bytes of a length prefix), garbage (random bytes), and strangers (a correct
handshake from a fresh identity, refused; reconnecting whenever closed). Every attacker loop is
bounded in count and time.

Reported: time-to-all of both runs and their ratio (aim: within 1.3x), each relay's peak RSS and
peak open files during the attacked run, the attacker's connection count, how each relay refused
them, and whether any relay exited.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = ("idle", "half", "garbage", "stranger")


# -- the attacker (runs inside its lab host) ---------------------------------------------------


async def attack(targets: list[tuple[str, str]], per_target: int, duration_s: float) -> dict:
    """Hold `per_target` hostile connections to each (address, peer id) for `duration_s`."""
    import trio

    from p2pnet.dataplane import open_data_stream
    from p2pnet.identity import Identity
    from p2pnet.wire import Codec

    stats = {"opened": 0, "failed": 0, "closed_by_peer": 0}

    async def one(address: str, peer: str, kind: str) -> None:
        host, port = address.rsplit(":", 1)
        deadline = trio.current_time() + duration_s
        for _ in range(10_000):  # reconnect when the relay closes us, a bounded number of times
            if trio.current_time() >= deadline:
                return
            try:
                if kind == "stranger":
                    stream = await open_data_stream(address, "relay/chunks",
                                                    codec=Codec(Identity.from_seed_text(secrets.token_hex(8))),
                                                    peer=peer, timeout_s=5)
                else:
                    stream = await trio.open_tcp_stream(host, int(port))
                    if kind == "half":
                        await stream.send_all(b"\x00\x00")
                    elif kind == "garbage":
                        await stream.send_all(os.urandom(512))
                stats["opened"] += 1
            except Exception:  # noqa: BLE001 - refusals are what we are counting
                stats["failed"] += 1
                await trio.sleep(2.0)
                continue
            with trio.move_on_at(deadline):
                try:
                    while await stream.receive_some(4096):
                        pass
                except (trio.BrokenResourceError, OSError):
                    pass  # reset by the relay: as good as closed
                stats["closed_by_peer"] += 1
            await stream.aclose()

    async def stop_on_term(cancel: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                cancel.cancel()
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_term, nursery.cancel_scope)
        for address, peer in targets:
            for i in range(per_target):
                nursery.start_soon(one, address, peer, KINDS[i % len(KINDS)])
    return stats


# -- the honest side -------------------------------------------------------------------------


def sample(pid: int) -> tuple[int, int]:
    rss = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def run(lab, root: Path, source: Path, args: argparse.Namespace, attacked: bool) -> dict:
    from p2pnet.localnet import control_call, relay_network, wait_for

    config = ("chunk_bytes = 1048576\nfsync = false\nannounce_interval_s = 5.0\n"
              "[peertable]\nheartbeat_interval_s = 5.0\nexpiry_s = 20.0\n")
    attacker = None
    peaks: dict[str, dict[str, int]] = {}
    try:
        # peer i runs on lab host r<i>, listening on its host's address (0.0.0.0: the host has one)
        with relay_network(root, args.relays - 1, config=config, args=["--listen", "/ip4/0.0.0.0/tcp/0"],
                           wrap_for={i: lab.wrap(f"r{i}") for i in range(args.relays)}, ready_timeout_s=120,
                           tables_timeout_s=180, reachable_timeout_s=180, stop_timeout_s=20) as net:
            peers = net.peers
            if attacked:
                targets = ",".join(f"{p.status()['data_addr']}={p.peer_id}" for p in peers)
                attacker = lab.popen("evil", [sys.executable, str(Path(__file__).resolve()), "attack", targets,
                                              str(args.per_relay), str(args.attack_s)],
                                     stdout=subprocess.PIPE, text=True)
                time.sleep(args.ramp_s)  # let the flood reach every relay before the publish
            started = time.time()
            control_call(peers[0].data_dir, {"cmd": "checkpoint.publish", "paths": [str(source)], "model": "bench",
                                             "version": 1, "chunk_bytes": 1 << 20}, timeout_s=300)

            def done() -> bool:
                for p in peers:
                    rss, files = sample(p.proc.pid)
                    peak = peaks.setdefault(p.name, {"rss": 0, "files": 0})
                    peak["rss"], peak["files"] = max(peak["rss"], rss), max(peak["files"], files)
                return all("version 1 complete" in p.log_path.read_text() for p in peers[1:])

            wait_for(done, args.timeout_s, "every relay completes", poll_s=0.5)
            times = [p.status()["role_status"]["relay"]["timeline"]["1"]["complete_at_s"] for p in peers[1:]]
            refused = {p.name: p.status()["data_refused"] for p in peers}
            alive = all(p.alive() for p in peers)
        codes = [p.proc.returncode for p in peers]  # (the network stopped them, the attacker still at it)
    finally:
        attack_stats = None
        if attacker is not None:
            attacker.terminate()
            out, _ = attacker.communicate(timeout=30)
            attack_stats = out.strip().splitlines()[-1] if out.strip() else None
    return {"attacked": attacked, "time_to_all_s": max(times) - started, "peaks": peaks, "refused": refused,
            "alive_until_stop": alive, "exit_codes": codes, "attacker": attack_stats}


def main(argv: list[str] | None = None) -> int:
    from p2pnet.lab import HostSpec, Lab, LabSpec, lab_unavailable

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--relays", type=int, default=8)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--per-relay", type=int, default=1000)
    parser.add_argument("--link-mbit", type=float, default=200.0)
    parser.add_argument("--attack-s", type=float, default=300.0, help="how long the attacker keeps at it, at most")
    parser.add_argument("--ramp-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    reason = lab_unavailable()
    if reason:
        print(reason)
        return 2
    hosts = [HostSpec(f"r{i}", args.link_mbit, args.link_mbit) for i in range(args.relays)]
    hosts.append(HostSpec("evil", args.link_mbit, args.link_mbit))
    with tempfile.TemporaryDirectory(prefix="p2pnet-attack-") as tmp:
        root = Path(tmp)
        from benchmarks.bench_lab_relay import make_checkpoint

        source = make_checkpoint(root / "model.safetensors", args.mib)
        with Lab.up(LabSpec(tuple(hosts), f"a{secrets.token_hex(3)}", mtu=9000), root / "lab") as lab:
            calm = [run(lab, root / "calm0", source, args, attacked=False)]  # before and after: no order effect
            print(f"without attack: time-to-all {calm[0]['time_to_all_s']:.2f}s", flush=True)
            stormy = run(lab, root / "attacked", source, args, attacked=True)
            print(f"under attack:   time-to-all {stormy['time_to_all_s']:.2f}s", flush=True)
            calm.append(run(lab, root / "calm1", source, args, attacked=False))
            print(f"without attack: time-to-all {calm[1]['time_to_all_s']:.2f}s", flush=True)
    calm_s = sum(c["time_to_all_s"] for c in calm) / len(calm)
    ratio = stormy["time_to_all_s"] / calm_s
    print(f"under attack {stormy['time_to_all_s']:.2f}s vs {calm_s:.2f}s without (mean of the runs before and after): "
          f"{ratio:.2f}x; relays alive throughout: "
          f"{stormy['alive_until_stop']}; exit codes {stormy['exit_codes']}")
    print(f"attacker: {stormy['attacker']}")
    for name, peak in stormy["peaks"].items():
        print(f"  {name}: peak RSS {peak['rss'] / 2**20:.0f} MiB, peak open files {peak['files']}, "
              f"refused {stormy['refused'][name]}")
    if args.json:
        args.json.write_text(json.dumps({"calm": calm, "attacked": stormy, "ratio": ratio}, indent=2))
    calm_peaks = {name: max(c["peaks"][name]["rss"] for c in calm) for name in stormy["peaks"]}
    print("peak RSS without attack: " + ", ".join(f"{n} {v / 2**20:.0f} MiB" for n, v in calm_peaks.items()))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "attack":
        import resource

        import trio

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        pairs = [t.split("=", 1) for t in sys.argv[2].split(",")]
        result = trio.run(attack, [(a, p) for a, p in pairs], int(sys.argv[3]), float(sys.argv[4]))
        print(json.dumps(result), flush=True)
        sys.exit(0)
    sys.exit(main())

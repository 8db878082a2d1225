"""Loading a complete checkpoint version from the relay store into a model: time and peak memory.

    python benchmarks/bench_load.py --mib 1024 --runs 3

The model (`--mib` of float32 Linear weights) is built first; then one of two loaders fills it,
each in a fresh process, alternating, median of `--runs`:

- `joined` (how a worker loaded a version before the store kept versions as files): every
  chunk read back and hashed, each file joined into one bytes object, parsed by
  `safetensors.torch.load`, then `model.load_state_dict`.
- `load_into` (now): every chunk hashed from the version's file (`ChunkStore.verify`), the files
  memory-mapped by safetensors, each tensor copied into its parameter in place.

Peak extra memory is what the process held beyond the built model: private (anonymous) bytes
from /proc/self/smaps_rollup sampled every 5 ms, and the peak resident set (VmHWM, which also
counts the mapped file's pages) minus the resident set before loading.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WIDTH = 4096
NOW = 1_800_000_000.0


def build(mib: int):
    import torch

    layers = max(1, (mib << 20) // (WIDTH * WIDTH * 4))
    with torch.no_grad():
        return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


def memory() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("Rss", "Private_Clean", "Private_Dirty", "Anonymous"):
            out[key] = int(line.split()[1]) * 1024
    return out


def hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def child(store_dir: str, mib: int, how: str) -> None:
    import torch

    torch.set_num_threads(1)
    from relay.loader import load_into
    from relay.store import ChunkStore
    from p2pnet.identity import Identity

    store = ChunkStore(Path(store_dir), budget_bytes=1 << 40, trusted_publishers=[Identity.from_seed_text("t").peer_id],
                       fsync=False)
    model = build(mib)
    before = memory()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    peak = {"anon": before["Anonymous"]}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak["anon"] = max(peak["anon"], memory()["Anonymous"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if how == "joined":
        from safetensors.torch import load

        signed = store.manifest(1)
        for entry in signed.manifest.files:
            blob = b"".join(store.read_chunk(1, i) for i in range(len(signed.manifest.chunk_digests)))
            model.load_state_dict(load(blob[entry.offset:entry.offset + entry.size]))
            del blob
    else:
        load_into(model, store, 1)
    took = time.perf_counter() - start
    done.set()
    sampler.join()
    print(json.dumps({"seconds": took, "extra_private": peak["anon"] - before["Anonymous"],
                      "extra_rss": hwm() - before["Rss"]}))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--mib", type=int, default=1024, help="model size in MiB (default 1024)")
    parser.add_argument("--runs", type=int, default=3, help="runs per loader; medians are reported (default 3)")
    args = parser.parse_args()
    import torch
    from safetensors.torch import save_file

    from p2pnet.identity import Identity
    from relay.store import ChunkStore

    torch.set_num_threads(1)
    results: dict[str, list[dict]] = {"joined": [], "load_into": []}
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        weights = Path(tmp) / "model.safetensors"
        model = build(args.mib)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
        size = weights.stat().st_size
        del model
        trainer = Identity.from_seed_text("t")
        store = ChunkStore(Path(tmp) / "store", budget_bytes=1 << 40, trusted_publishers=[trainer.peer_id], fsync=False)
        store.publish_files(trainer, [weights], model="bench", version=1, now_s=NOW, place="move")
        for _ in range(args.runs):
            for how in results:
                out = subprocess.run([sys.executable, __file__, "--child", str(store.root), str(args.mib), how],
                                     check=True, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                results[how].append(json.loads(out.stdout))
    print(f"loading a {size / 2**20:.0f} MiB version into a model, median of {args.runs}")
    print(f"{'':10} {'seconds':>8} {'extra private MiB':>18} {'extra RSS MiB':>14}")
    for how, rows in results.items():
        print(f"{how:<10} {statistics.median(r['seconds'] for r in rows):8.2f} "
              f"{statistics.median(r['extra_private'] for r in rows) / 2**20:18.0f} "
              f"{statistics.median(r['extra_rss'] for r in rows) / 2**20:14.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A worker's (or validator's) first load of a policy version: time and peak extra memory.

    python benchmarks/bench_version_load.py --runs 3

A Llama model of about 134 M parameters (hidden 768, 12 layers, vocabulary 32,000; float32,
536 MB; the largest tensor, the embedding, 98 MB) is saved as a sharded model folder (the
worker's base folder) and published into a relay store as version 1. Each loader then runs in
a fresh process, alternating, median of `--runs`:

- `before` (what the roles did before issue 17: `trainer.model.load_model_dir` built the model
  from its config, read the one weights file whole with `safetensors.torch.load_file`, copied it
  in with `load_state_dict`; then `relay.loader.load_into` put version 1's weights in);
- `after` (`models.weights.load_version`: `from_pretrained` on the base folder, memory-mapped,
  then `load_into`, memory-mapped, tensor by tensor).

and, for an engine with weights of its own (vLLM), version 1 pushed into its model:

- `push_before` (the vLLM backend before: `snapshot_state`, a whole CPU copy of the worker's
  model, handed to the engine's `load_weights`);
- `push_after` (now: `models.weights.stream_tensors` over the version's verified files).

Peak extra memory is the private (anonymous) memory the process held at its peak, above what
it held before the load, minus the loaded model's own bytes (sampled every 5 ms from
/proc/self/smaps_rollup): what a load costs beyond the model it produces. The aim is at most
1.2x the largest tensor.
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

NOW = 1_800_000_000.0


def anonymous() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Anonymous line")


def load_before(base: Path, store, version: int):
    """The roles' load before: from_config, the whole file read, load_state_dict, then load_into."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from relay.loader import load_into

    config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config)
    state: dict = {}
    for shard in sorted(base.glob("model*.safetensors")):
        state.update(load_file(str(shard)))
    model.load_state_dict(state, strict=False)
    del state
    load_into(model, store, version)
    return model


def child(tmp: str, how: str) -> None:
    import torch

    torch.set_num_threads(1)
    from models.weights import load_version
    from p2pnet.identity import Identity
    from relay.store import ChunkStore

    store = ChunkStore(Path(tmp) / "store", budget_bytes=1 << 40,
                       trusted_publishers=[Identity.from_seed_text("t").peer_id], fsync=False)
    base = Path(tmp) / "base"
    import transformers  # noqa: F401 (imported before the baseline: not part of a load)

    engine = None
    if how.startswith("push"):  # an engine's own model (vLLM's), and the worker's model of version 1
        from models.folder import load_model_dir

        engine = load_model_dir(base)[0]
        with torch.no_grad():  # private memory, as an engine's (GPU) weights are: not pages of the base files
            for param in engine.parameters():
                param.data = param.data.clone()
        worker = load_version(base, store, 1)[0]

    start_anon = anonymous()
    peak = {"anon": start_anon}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak["anon"] = max(peak["anon"], anonymous())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    if how == "before":
        model = load_before(base, store, 1)
    elif how == "after":
        model = load_version(base, store, 1)[0]
    else:  # what an engine's load_weights receives: a copy of the model, or tensors streamed from files
        from models.weights import snapshot_state, stream_tensors

        assert engine is not None  # loaded above for every push_* case
        weights = (list(snapshot_state(worker).items()) if how == "push_before"
                   else stream_tensors(store.version_files(1)))
        params = engine.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
        del weights
        model = torch.nn.Module()  # nothing new is held: the engine's model already was
    took = time.perf_counter() - start
    done.set()
    sampler.join()
    end_anon = anonymous()
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"seconds": took, "peak_extra": max(peak["anon"], end_anon) - start_anon - model_bytes,
                      "model_bytes": model_bytes, "held": end_anon - start_anon}))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="runs per loader; medians are reported (default 3)")
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.folder import model_files, save_model_dir
    from models.tokenizer import CharTokenizer
    from p2pnet.identity import Identity
    from relay.store import ChunkStore

    torch.set_num_threads(1)
    results: dict[str, list[dict]] = {"before": [], "after": [], "push_before": [], "push_after": []}
    with tempfile.TemporaryDirectory(prefix="bench-version-load-") as tmp:
        config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
        largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
        base = save_model_dir(model, CharTokenizer(), Path(tmp) / "base", max_shard_bytes=200_000_000)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        v1 = save_model_dir(model, CharTokenizer(), Path(tmp) / "v1", max_shard_bytes=200_000_000)
        del model
        trainer = Identity.from_seed_text("t")
        store = ChunkStore(Path(tmp) / "store", budget_bytes=1 << 40, trusted_publishers=[trainer.peer_id],
                           fsync=False)
        store.publish_files(trainer, model_files(v1), model="bench", version=1, now_s=NOW, place="move")
        for _ in range(args.runs):
            for how in results:
                out = subprocess.run([sys.executable, __file__, "--child", tmp, how], check=True,
                                     capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                results[how].append(json.loads(out.stdout.strip().splitlines()[-1]))
    model_mib = results["after"][0]["model_bytes"] / 2**20
    print("before/after: a worker's first load of version 1 (base folder, then the version's weights);")
    print("push_before/push_after: version 1 into an engine's own model, from a copy / streamed from files")
    print(f"first load of a version: {model_mib:.0f} MiB model, largest tensor {largest / 2**20:.0f} MiB, "
          f"median of {args.runs}")
    print(f"{'':8} {'seconds':>8} {'peak extra MiB':>15} {'x largest tensor':>17} {'held after MiB':>15}")
    for how, rows in results.items():
        extra = statistics.median(r["peak_extra"] for r in rows)
        held = statistics.median(r["held"] for r in rows)
        print(f"{how:<8} {statistics.median(r['seconds'] for r in rows):8.2f} {extra / 2**20:15.0f} "
              f"{extra / largest:17.2f} {held / 2**20:15.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Device check for trainer/vllm_backend.py: generate with vLLM, verify with a transformers recomputation.

Run on a machine with a CUDA GPU and vllm installed (it exits with status 2 otherwise):

    python scripts/gpu_check_vllm.py                       # tiny random "small" model, eager
    python scripts/gpu_check_vllm.py --cuda-graphs         # the same with CUDA graphs on
    python scripts/gpu_check_vllm.py --model-dir models/smollm2 --max-new-tokens 64

What it checks and prints (and writes as JSON to $OUT/gpu_check_vllm.json when $OUT is set):
- the engine starts with our logits processor, worker extension and capture hook;
- every rollout passes `verify.check.check_rollout` against a transformers recomputation
  (fp32 on the GPU, hidden states cast to bf16): acceptance rate, the worst sampling-replay
  deficit (margin 1.0), TOPLOC exponent mismatches and mantissa mean / median per chunk;
- two consecutive policy versions, as a worker runs them: version 0 and version 1 are model
  folders (sharded safetensors); the engine starts from version 0's folder as it is, then
  version 1 is swapped into the SAME torch model object and the engine is handed version 1's
  files: the push is keyed by the version number and streamed from the files, and version 1's
  rollouts verify against version 1 and not against version 0 (the weight push really took);
- timing: engine start, weight push, generation, proofs; token agreement with the torch
  generator on the same weights (informational: bf16 and fp32 logits may split near-ties).
Exit status 0 only when every rollout of both models is accepted and the cross-check rejects.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tempfile  # noqa: E402

from models.folder import load_model_dir, save_model_dir, weight_files  # noqa: E402
from models.tiny import build_model  # noqa: E402
from models.weights import stream_tensors  # noqa: E402
from tasks.prompts import assign_prompts  # noqa: E402
from trainer.rollout import GenerationConfig, RolloutBatch, generate_batch  # noqa: E402
from trainer.vllm_backend import VllmConfig, VllmEngine, VllmGenerator, vllm_status  # noqa: E402
from verify.check import Forward, check_rollout  # noqa: E402


def make_forward(model: Any, device: str) -> Forward:
    ref = model.to(device=device, dtype=torch.float32).eval()

    @torch.no_grad()
    def forward(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([list(ids)], dtype=torch.long, device=device)
        hidden = ref.model(input_ids=x, use_cache=False).last_hidden_state
        logits = ref.lm_head(hidden).float()
        return hidden[0].to(torch.bfloat16).cpu(), logits[0].cpu()

    return forward


def verify(batch: RolloutBatch, forward: Forward, eos_id: int) -> dict[str, Any]:
    verdicts = [check_rollout(forward, r.prompt_ids, r.output_ids, r.proofs, seed=batch.sampling_seed,
                              row=r.row, temperature=batch.temperature, eos_token_id=eos_id,
                              max_new_tokens=batch.max_new_tokens)
                for r in batch.rollouts]
    chunks = [c for v in verdicts for c in v.chunk_stats]
    reasons: dict[str, int] = {}
    for v in verdicts:
        for reason in v.reasons:
            reasons[reason] = reasons.get(reason, 0) + 1
    deficits = [v.sampling.max_deficit for v in verdicts if v.sampling is not None]
    return {
        "rollouts": len(verdicts),
        "accepted": sum(v.accepted for v in verdicts),
        "acceptance_rate": round(sum(v.accepted for v in verdicts) / max(1, len(verdicts)), 4),
        "reasons": reasons,
        "sampling_max_deficit": round(max(deficits, default=0.0), 4),
        "sampling_median_deficit": round(statistics.median(deficits), 4) if deficits else 0.0,
        "chunks": len(chunks),
        "exp_mismatches_max": max((c.exp_mismatches for c in chunks), default=0),
        "mant_mean_max": round(max((c.mant_err_mean for c in chunks), default=0.0), 3),
        "mant_median_max": round(max((c.mant_err_median for c in chunks), default=0.0), 3),
        "stop_reasons": {s: sum(r.stop_reason == s for r in batch.rollouts) for s in ("eos", "length")},
        "tokens": batch.n_output_tokens,
    }


def version_folders(model_dir: str, work: Path) -> list[Path]:
    """Two consecutive versions as model folders of sharded safetensors: `model_dir` and a copy with
    every weight moved by 5% of its spread, or two random "small" models."""
    if model_dir:
        model, tok = load_model_dir(model_dir)
        first = save_model_dir(model, tok, work / "v0", max_shard_bytes=50_000_000)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * p.float().std().to(p.dtype) * 0.05)
        return [first, save_model_dir(model, tok, work / "v1", max_shard_bytes=50_000_000)]
    return [save_model_dir(*build_model("small", seed=s), work / f"v{s}", max_shard_bytes=1_000_000) for s in (0, 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="", help="a model folder (trainer.model layout); default: tiny 'small'")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--cuda-graphs", action="store_true", help="enforce_eager=False")
    args = ap.parse_args()

    usable, why = vllm_status()
    if not usable:
        print(f"SKIP: vLLM backend unusable here: {why}")
        return 2
    import vllm

    work = tempfile.TemporaryDirectory(prefix="gpu-check-")
    folders = version_folders(args.model_dir, Path(work.name))
    model, tok = load_model_dir(folders[0])
    device = "cuda"
    cfg = GenerationConfig(group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature)
    tasks = assign_prompts("gpu-check", 0, 7, args.prompts)
    report: dict[str, Any] = {"vllm": vllm.__version__, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0), "cuda_graphs": args.cuda_graphs,
                    "model": args.model_dir or "tiny small (random init)"}

    torch_batch, _ = generate_batch(model, tok, tasks, worker_id="gpu-check", step=0, model_version=0, seed=7,
                                    config=GenerationConfig(group_size=args.group_size,
                                                            max_new_tokens=args.max_new_tokens,
                                                            temperature=args.temperature, proofs=False))
    # the engine is kept by its own type: what it started from and pushed is VllmEngine's, not Engine's
    engine = VllmEngine(VllmConfig(enforce_eager=not args.cuda_graphs, gpu_memory_utilization=0.4))
    gen = VllmGenerator(engine=engine)
    t0 = time.perf_counter()
    batch, timing = gen(model, tok, tasks, worker_id="gpu-check", step=0, model_version=0, seed=7, config=cfg,
                        weight_files=weight_files(folders[0]))
    report["first_call_s"] = round(time.perf_counter() - t0, 3)
    report["started_from_version_folder"] = engine.started_from == folders[0]
    report["timing"] = {"generate_s": round(timing.generate_s, 4), "proof_s": round(timing.proof_s, 4),
                        **{k: round(v, 3) for k, v in timing.extra.items()}}
    same = [a.output_ids == b.output_ids for a, b in zip(torch_batch.rollouts, batch.rollouts)]
    report["torch_token_agreement"] = round(sum(same) / len(same), 4)
    v0 = make_forward(load_model_dir(folders[0])[0], device)
    report["version_0"] = verify(batch, v0, tok.eos_id)
    ok = report["version_0"]["acceptance_rate"] == 1.0 and report["started_from_version_folder"]

    with torch.no_grad():  # the worker's swap: version 1 into the same object
        params = model.state_dict()
        for name, tensor in stream_tensors(weight_files(folders[1])):
            params[name].copy_(tensor)
    batch_b, timing_b = gen(model, tok, tasks, worker_id="gpu-check", step=1, model_version=1, seed=7, config=cfg,
                            weight_files=weight_files(folders[1]))
    report["weights_push"] = {k: round(v, 3) for k, v in timing_b.extra.items()}
    report["pushed_versions"] = list(engine.pushes)
    report["version_1"] = verify(batch_b, make_forward(load_model_dir(folders[1])[0], device), tok.eos_id)
    report["version_1_against_0"] = verify(batch_b, v0, tok.eos_id)
    ok = ok and report["pushed_versions"] == [1] and report["version_1"]["acceptance_rate"] == 1.0
    ok = ok and report["version_1_against_0"]["acceptance_rate"] < 0.5

    report["ok"] = ok
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        suffix = "_graphs" if args.cuda_graphs else ""
        Path(os.environ["OUT"], f"gpu_check_vllm{suffix}.json").write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

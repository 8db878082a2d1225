"""Device check for trainer/sharded.py and trainer/ranks.py: FSDP2 ranks on GPUs with NCCL.

Run on a machine with CUDA GPUs (it exits with status 2, saying why, when there is none):

    python scripts/gpu_check_fsdp.py                 # one rank per GPU, the "small" tiny model
    python scripts/gpu_check_fsdp.py --ranks 2 --steps 4
    python scripts/gpu_check_fsdp.py --cpu           # the same check on CPU ranks (gloo): a rehearsal

Several ranks need several GPUs (NCCL refuses two ranks on one device); on a one-GPU machine
it checks one NCCL rank and says so.

What it checks and prints (and writes as JSON to $OUT/gpu_check_fsdp.json when $OUT is set):
- a `LearnerGroup` of N ranks (torchrun, NCCL, `fully_shard` per decoder layer and root) trains
  STEPS steps on teaching batches and publishes every version; its last version is compared with
  the one-process learner's on the CPU (float32 both; GPU and CPU kernels round differently, so
  the tolerance is wider than the CPU test's: every weight within 1e-3, at most 0.1% beyond 1e-5);
- the DCP checkpoints are asynchronous: the part of a save the step waits for against the whole
  save (staging copies GPU tensors to host memory, then DCP's thread writes);
- a group killed after two steps resumes from its newest complete DCP checkpoint and then
  publishes exactly what the uninterrupted group published;
- per rank: step time, peak GPU memory allocated, peak resident memory.
Exit status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

TOL_WEIGHT, TOL_SHARE = 1e-3, 1e-3


def weights(out_dir: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from models.folder import weight_files
    from trainer.checkpoint import version_dir

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(version_dir(out_dir, version)):
        state.update(load_file(str(path)))
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=0, help="ranks (default: one per GPU)")
    parser.add_argument("--model", default="small", help="a tiny model name (tiny, micro, small)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="rehearse on CPU ranks with gloo")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check_fsdp: skipped: no CUDA GPU here (torch.cuda.is_available() is False); "
              "run it where a GPU is lent, or rehearse with --cpu")
        return 2
    gpus = 0 if args.cpu else torch.cuda.device_count()
    ranks = args.ranks or max(gpus, 2 if args.cpu else 1)
    if not args.cpu and ranks > gpus:
        print(f"gpu_check_fsdp: {ranks} ranks asked, {gpus} GPU(s) here: checking {gpus} (one rank per GPU)")
        ranks = gpus
    if ranks == 1:
        print("gpu_check_fsdp: one rank only: FSDP2 and NCCL run, but nothing is sharded across devices")
    from trainer.learner import Learner, LearnerConfig
    from trainer.model import build_model, save_model_dir
    from trainer.ranks import GroupConfig, LearnerGroup
    from trainer.sharded import complete_checkpoints
    from trainer.teaching import teaching_batches

    device = "cpu" if args.cpu else "cuda"
    cfg = LearnerConfig(prompts_per_batch=16, group_size=8, keep_last=0, use_worker_logprobs=False)
    report: dict = {"ranks": ranks, "device": device, "model": args.model, "steps": args.steps,
                    "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)], "checks": {}}
    checks = report["checks"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, tok = build_model(args.model, seed=0)
        base = save_model_dir(model, tok, work / "base")
        batches = teaching_batches(model, tok, cfg, args.steps)
        reference = Learner(cfg, base, work / "one")
        one_losses = [reference.step([b]).loss for b in batches]
        reference.close()

        group = LearnerGroup(cfg, base, work / "group", GroupConfig(ranks=ranks, device=device))
        rows = []
        try:
            for b in batches:
                t0 = time.perf_counter()
                stats = group.step([b])
                timing = group.last_checkpoint
                rows.append({"step_s": round(time.perf_counter() - t0, 4), "loss": stats.loss,
                             "dcp_blocking_s": timing and round(timing.blocking_s, 4),
                             "dcp_total_s": timing and round(timing.total_s, 4)})
            group.flush()
            report["memory"] = group.memory()
        finally:
            group.close()
        report["steps_detail"] = rows
        one, many = weights(work / "one", args.steps), weights(work / "group", args.steps)
        worst = max(float((one[k] - many[k]).abs().max()) for k in one)
        beyond = sum(int(((one[k] - many[k]).abs() > 1e-5).sum()) for k in one)
        total = sum(t.numel() for t in one.values())
        loss_gap = max(abs(a - r["loss"]) for a, r in zip(one_losses, rows))
        checks["matches_one_process"] = {"ok": worst <= TOL_WEIGHT and beyond <= TOL_SHARE * total,
                                         "max_abs_diff": worst, "share_beyond_1e-5": beyond / total,
                                         "max_loss_gap": loss_gap}
        saves = [r for r in rows if r["dcp_total_s"] is not None]
        checks["dcp_async"] = {"ok": bool(saves),
                               "blocking_s_median": statistics.median(r["dcp_blocking_s"] for r in saves) if saves else None,
                               "total_s_median": statistics.median(r["dcp_total_s"] for r in saves) if saves else None}

        out = work / "killed"
        group = LearnerGroup(cfg, base, out, GroupConfig(ranks=ranks, device=device))
        try:
            for b in batches[:2]:
                group.step([b])
            group.flush()
        finally:
            group.kill()
        saved = complete_checkpoints(out)
        group = LearnerGroup(cfg, base, out, GroupConfig(ranks=ranks, device=device))
        try:
            resumed_at = group.version
            while group.version < args.steps:
                group.step([batches[group.version]])
            group.flush()
        finally:
            group.close()
        again = weights(out, args.steps)
        checks["resume"] = {"ok": bool(saved) and resumed_at == saved[-1]
                            and all(torch.equal(many[k], again[k]) for k in many), "resumed_at": resumed_at}
    ok = all(c["ok"] for c in checks.values())
    report["ok"] = ok
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check_fsdp.json").write_text(text)
    print(f"gpu_check_fsdp: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

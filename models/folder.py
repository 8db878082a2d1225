"""Model folders on disk, in and out through transformers' own `from_pretrained` / `save_pretrained`.

Owns the folder format every role reads and the trainer writes: Hugging Face's standard layout,
`config.json`, `generation_config.json`, the tokenizer files, and the weights as one
`model.safetensors` or as shards `model-0000x-of-0000y.safetensors` with their
`model.safetensors.index.json` (every Hub model over a few GB). `save_model_dir` and
`write_model_folder` write through `save_pretrained` (configurable shard size, safetensors with
their `format: pt` metadata) in the model's compute dtype; `load_model_dir` reads through
`from_pretrained` and refuses a folder whose weights do not fill the model exactly (transformers
would otherwise fill the gap with random values and only warn). `compute_dtype` is the dtype a
folder declares (`dtype` / `torch_dtype` in config.json): what workers and validators run in and
what the trainer publishes; the trainer may keep fp32 master weights beside it.

A folder is written under a temporary name, fsynced and renamed: it exists under its final
name only once complete.

Must not: download from a model hub (every load is `local_files_only`), open sockets, or know
about training, tasks or proofs.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from p2pnet.files import fsync_dir
from models.tokenizer import load_tokenizer

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 1_000_000_000
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelFolderError(RuntimeError):
    """A model folder on disk is missing files or does not match its config."""


def _quiet_transformers() -> None:
    """No per-file progress bars from transformers in peers' logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, Any]:
    """`dtype=` (transformers >= 4.56) or `torch_dtype=` (older) for from_pretrained/from_config."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def weight_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files holding a folder's weights: the shards named by the index, or the
    single `model.safetensors`. ModelFolderError when neither is there (or a shard is missing)."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelFolderError(f"{index} is not a safetensors index: {exc}") from exc
        names = sorted(set(weight_map.values()))
        files = [folder / n for n in names]
        missing = [n for n, f in zip(names, files) if not f.is_file() or Path(n).name != n]
        if missing:
            raise ModelFolderError(f"{folder} lacks shard(s) {missing[:3]} named in {WEIGHTS_INDEX_FILE}")
        return files
    single = folder / WEIGHTS_FILE
    if single.is_file():
        return [single]
    raise ModelFolderError(f"{folder} has no {WEIGHTS_FILE} and no {WEIGHTS_INDEX_FILE}")


def model_files(folder: str | os.PathLike[str]) -> list[Path]:
    """Every file a model folder consists of (what the trainer publishes): config, generation
    config, tokenizer files, weights and their index; nothing else (no optimizer state)."""
    folder = Path(folder)
    keep = [folder / CONFIG_FILE]
    for name in (GENERATION_CONFIG_FILE, WEIGHTS_INDEX_FILE):
        if (folder / name).is_file():
            keep.append(folder / name)
    keep += sorted(p for p in folder.iterdir() if p.is_file() and _is_tokenizer_file(p.name))
    return keep + weight_files(folder)


def _is_tokenizer_file(name: str) -> bool:
    return name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json")


def read_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelFolderError(f"{folder} has no {CONFIG_FILE}") from exc
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{path} is not JSON: {exc}") from exc


def compute_dtype(folder: str | os.PathLike[str]) -> torch.dtype:
    """The dtype a folder's config declares (float32 when it says nothing)."""
    config = read_config(folder)
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ModelFolderError(f"{folder}: dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_model_dir(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None):
    """(model in eval mode, tokenizer) from a model folder, single-file or sharded.

    The model is in the folder's compute dtype unless `dtype` says otherwise (the trainer asks
    for float32 master weights). ModelFolderError when files are missing or the weights do not
    fill the model exactly."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    wanted = dtype if dtype is not None else compute_dtype(path)
    weight_files(path)  # a clear error before transformers' own
    _quiet_transformers()
    with torch.random.fork_rng(devices=[]):
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, output_loading_info=True, **_dtype_kwarg(wanted))
        except (OSError, ValueError) as exc:
            raise ModelFolderError(f"{path} does not load: {exc}") from exc
    problems = {k: sorted(v)[:5] for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise ModelFolderError(f"{path}: weights do not fit the config: {problems or info['error_msgs'][:3]}")
    model.eval()
    return model, load_tokenizer(path)


def skeleton(model: Any, dtype: torch.dtype) -> Any:
    """A weightless copy of `model`'s architecture (meta device) whose config says `dtype`: what
    `write_model_folder` saves from, so the live model can go on training meanwhile."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    setattr(config, "dtype" if _dtype_kwarg(dtype).keys() == {"dtype"} else "torch_dtype", dtype)
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        shell = AutoModelForCausalLM.from_config(config)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        shell.generation_config = copy.deepcopy(generation)
    return shell


def state_in_dtype(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the weights in `dtype` (float tensors only are cast), with tied
    (shared-storage) duplicates dropped: the first name of each storage is kept."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = t.detach().to("cpu", dtype=dtype if t.is_floating_point() else t.dtype, copy=True).contiguous()
    return out


def write_model_folder(folder: str | os.PathLike[str], shell: Any, tokenizer: Any,
                       state: Mapping[str, torch.Tensor], *,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write config, generation config, tokenizer and the weights `state` (sharded at
    `max_shard_bytes`) into an existing folder with `shell.save_pretrained`, and fsync it."""
    if max_shard_bytes < 1:
        raise ValueError("max_shard_bytes must be positive")
    folder = Path(folder)
    _quiet_transformers()
    # save_pretrained empties the dict it is handed; tied duplicates are dropped by it
    shell.save_pretrained(str(folder), state_dict=dict(state), max_shard_size=int(max_shard_bytes),
                          safe_serialization=True)
    tokenizer.save(folder)
    for child in folder.iterdir():
        if child.is_file():
            os.chmod(child, 0o644)
            with open(child, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def save_model_dir(model: Any, tokenizer: Any, path: str | os.PathLike[str], *,
                   dtype: torch.dtype | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Save a model folder (weights in `dtype`, default the model's own); it appears under its
    final name only once complete."""
    path = Path(path)
    if path.exists():
        raise ModelFolderError(f"{path} already exists; refusing to overwrite a model folder")
    dtype = dtype or next(model.parameters()).dtype
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(tmp, 0o755)
    try:
        write_model_folder(tmp, skeleton(model, dtype), tokenizer, state_in_dtype(model, dtype),
                           max_shard_bytes=max_shard_bytes)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)
    return path


def describe_model_dir(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Small summary for CLIs: model type, sizes, dtype, weight files and bytes."""
    config = read_config(path)
    files = weight_files(path)
    return {
        "model_type": config.get("model_type"),
        "hidden_size": config.get("hidden_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "vocab_size": config.get("vocab_size"),
        "dtype": str(compute_dtype(path)).removeprefix("torch."),
        "weight_files": len(files),
        "weights_bytes": sum(f.stat().st_size for f in files),
    }

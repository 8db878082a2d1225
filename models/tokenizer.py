"""Tokenizers of model folders: the tiny models' character tokenizer, and any Hugging Face one.

Owns `CharTokenizer`, the vocabulary of the tiny default models: three special tokens (pad=0,
bos=1, eos=2) followed by a fixed alphabet (by default digits and arithmetic operators;
`TEXT_ALPHABET` adds letters and punctuation for worded tasks), one id per character in the
order of the alphabet, so two peers that build it independently agree on every id. It is
saved with the `tokenizers` library in Hugging Face's standard format (`tokenizer.json`, a
WordLevel model over single characters with a lowercasing normalizer, plus
`tokenizer_config.json`), so `AutoTokenizer.from_pretrained` loads every folder this project
writes and gives the same ids. Encoding in the hot paths stays a dictionary lookup.

`HFTokenizer` gives any transformers tokenizer (SmolLM2's) the same small interface, chat
template included; `load_tokenizer(folder)` picks the right one for a folder (a character
vocabulary, as this module writes it or as the private format of earlier versions, comes back
as a `CharTokenizer` with the same ids).

Must not: know about models, tasks or any file but the tokenizer's own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from p2pnet.files import atomic_write_bytes

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS: tuple[str, ...] = (PAD, BOS, EOS)
# The default alphabet holds exactly what the arithmetic tasks need: a small vocabulary
# gives a random-init model a fair chance of well-formed answers from the first step.
ALPHABET = "0123456789+-*="
TEXT_ALPHABET = "0123456789+-*/=()., ?abcdefghijklmnopqrstuvwxyz"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
LEGACY_KIND = "p2pnet-char-v1"  # the private tokenizer.json of earlier versions (read only)
MAX_LENGTH = 1 << 20


class TokenizerError(ValueError):
    """The caller passed text or ids that this tokenizer cannot represent."""


@dataclass(frozen=True)
class CharTokenizer:
    """Maps each character of `alphabet` to one id, after the special tokens.

    Invariants: ids are dense in [0, vocab_size); pad=0, bos=1, eos=2; every character of
    `alphabet` is unique and lowercase (text is lowercased before encoding).
    """

    alphabet: str = ALPHABET
    _to_id: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet):
            raise TokenizerError("alphabet has repeated characters")
        if self.alphabet != self.alphabet.lower():
            raise TokenizerError("alphabet must be lowercase (text is lowercased before encoding)")
        object.__setattr__(self, "_to_id", {ch: len(SPECIALS) + i for i, ch in enumerate(self.alphabet)})

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def chat_template(self) -> str | None:
        return None  # a character model is not an instruct model

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = [self._to_id[ch] for ch in text.lower()]
        except KeyError as exc:
            raise TokenizerError(f"character {exc.args[0]!r} is not in the alphabet") from exc
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Characters for `ids`; special tokens are dropped, decoding stops at eos."""
        out: list[str] = []
        n_special = len(SPECIALS)
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i < 0 or i >= self.vocab_size:
                raise TokenizerError(f"id {i} is outside the vocabulary of {self.vocab_size}")
            if i >= n_special:
                out.append(self.alphabet[i - n_special])
        return "".join(out)

    def batch_encode(self, texts: Sequence[str], *, bos: bool = True) -> list[list[int]]:
        return [self.encode(t, bos=bos) for t in texts]

    # -- the standard format -------------------------------------------------------------

    def vocab(self) -> dict[str, int]:
        return {**{s: i for i, s in enumerate(SPECIALS)}, **self._to_id}

    def to_tokenizers(self) -> Any:
        """The same tokenizer as a `tokenizers.Tokenizer` (what `tokenizer.json` holds)."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

        tok = Tokenizer(models.WordLevel(vocab=self.vocab(), unk_token=None))
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
        return tok

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (each atomically)."""
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        atomic_write_bytes(path, self.to_tokenizers().to_str(pretty=True).encode())
        specials = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS}
        # PreTrainedTokenizerFast: the class name every transformers version maps to tokenizer.json
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MAX_LENGTH,
                  "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
                  **specials}
        atomic_write_bytes(folder / TOKENIZER_CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True).encode())
        atomic_write_bytes(folder / SPECIAL_TOKENS_FILE, json.dumps(specials, indent=2, sort_keys=True).encode())
        return path

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> "CharTokenizer":
        found = char_alphabet(folder)
        if found is None:
            raise TokenizerError(f"{Path(folder) / TOKENIZER_FILE} is not a character tokenizer")
        return cls(alphabet=found)


def char_alphabet(folder: str | os.PathLike[str]) -> str | None:
    """The alphabet when the folder's tokenizer.json is a character vocabulary (this module's
    standard file, or the private one of earlier versions); None for any other tokenizer."""
    path = Path(folder) / TOKENIZER_FILE
    if has_chat_template(folder):
        return None  # an instruct tokenizer: transformers applies its template
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get("kind") == LEGACY_KIND and tuple(data.get("specials", ())) == SPECIALS:
        return str(data["alphabet"])
    model = data.get("model")
    if not isinstance(model, dict) or model.get("type") != "WordLevel" or not isinstance(model.get("vocab"), dict):
        return None
    by_id = sorted((int(i), t) for t, i in model["vocab"].items())
    if [i for i, _ in by_id] != list(range(len(by_id))) or tuple(t for _, t in by_id[:3]) != SPECIALS:
        return None
    chars = [t for _, t in by_id[3:]]
    if not chars or any(len(c) != 1 for c in chars):
        return None
    return "".join(chars)


def has_chat_template(folder: str | os.PathLike[str]) -> bool:
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


class HFTokenizer:
    """Adapter giving a transformers tokenizer the same small interface as CharTokenizer."""

    def __init__(self, hf: Any) -> None:
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

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None) or None

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids + ([self.eos_id] if eos else [])

    def encode_chat(self, user_text: str) -> list[int]:
        """The ids of a one-turn chat asking `user_text`, ready for the assistant's answer."""
        ids = self.hf.apply_chat_template([{"role": "user", "content": user_text}], tokenize=True,
                                          add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

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


def load_tokenizer(folder: str | os.PathLike[str]) -> CharTokenizer | HFTokenizer:
    """The tokenizer of a model folder: a CharTokenizer for a character vocabulary, else the
    folder's transformers tokenizer."""
    alphabet = char_alphabet(folder)
    return CharTokenizer(alphabet=alphabet) if alphabet is not None else HFTokenizer.load(folder)

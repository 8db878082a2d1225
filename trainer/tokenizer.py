"""A character-level tokenizer built locally, with no downloads.

Owns the vocabulary for the tiny default model: three special tokens (pad, bos,
eos) followed by a fixed alphabet (by default digits and the arithmetic operators;
`TEXT_ALPHABET` adds letters and punctuation for worded tasks). Ids are deterministic
(the order of the alphabet), so two peers that build the tokenizer independently
agree on every id. Saved into a model folder as `tokenizer.json`.

Must not know about models, tasks or files other than its own JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS: tuple[str, ...] = (PAD, BOS, EOS)
# The default alphabet holds exactly what the arithmetic tasks need: a small vocabulary
# gives a random-init model a fair chance of well-formed answers from the first step.
ALPHABET = "0123456789+-*="
TEXT_ALPHABET = "0123456789+-*/=()., ?abcdefghijklmnopqrstuvwxyz"
TOKENIZER_FILE = "tokenizer.json"
KIND = "p2pnet-char-v1"


class TokenizerError(ValueError):
    """The caller passed text or ids that this tokenizer cannot represent."""


@dataclass(frozen=True)
class CharTokenizer:
    """Maps each character of `alphabet` to one id, after the special tokens.

    Invariants: ids are dense in [0, vocab_size); pad=0, bos=1, eos=2; every
    character of `alphabet` is unique.
    """

    alphabet: str = ALPHABET
    _to_id: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet):
            raise TokenizerError("alphabet has repeated characters")
        to_id = {ch: len(SPECIALS) + i for i, ch in enumerate(self.alphabet)}
        object.__setattr__(self, "_to_id", to_id)

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

    # -- persistence -------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {"kind": KIND, "specials": list(SPECIALS), "alphabet": self.alphabet},
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "CharTokenizer":
        data = json.loads(text)
        if data.get("kind") != KIND or tuple(data.get("specials", ())) != SPECIALS:
            raise TokenizerError(f"not a {KIND} tokenizer file")
        return cls(alphabet=str(data["alphabet"]))

    def save(self, folder: str | os.PathLike[str]) -> Path:
        path = Path(folder) / TOKENIZER_FILE
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> "CharTokenizer":
        return cls.from_json((Path(folder) / TOKENIZER_FILE).read_text(encoding="utf-8"))


def is_char_tokenizer_folder(folder: str | os.PathLike[str]) -> bool:
    path = Path(folder) / TOKENIZER_FILE
    if not path.exists():
        return False
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("kind") == KIND
    except (json.JSONDecodeError, AttributeError):
        return False

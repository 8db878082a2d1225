"""Compatibility name: the tokenizers live in `models.tokenizer` (one home for models)."""

from models.tokenizer import (ALPHABET, BOS, EOS, PAD, SPECIALS, TEXT_ALPHABET, TOKENIZER_FILE,  # noqa: F401
                              CharTokenizer, HFTokenizer, TokenizerError, char_alphabet, load_tokenizer)

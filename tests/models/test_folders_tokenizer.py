"""Model folders in and out through transformers: the character tokenizer in the standard format,
sharded folders, and the checks that keep a folder honest."""

from __future__ import annotations

import json

import pytest
import torch

torch.set_num_threads(1)

from models.folder import (ModelFolderError, WEIGHTS_INDEX_FILE, compute_dtype, describe_model_dir,  # noqa: E402
                           load_model_dir, model_files, save_model_dir, weight_files)
from models.tiny import build_model  # noqa: E402
from models.tokenizer import (TEXT_ALPHABET, CharTokenizer, LEGACY_KIND, SPECIALS, load_tokenizer)  # noqa: E402


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_auto_tokenizer_loads_the_character_tokenizer_with_the_same_ids(tmp_path):
    from transformers import AutoTokenizer

    tok = CharTokenizer(alphabet=TEXT_ALPHABET)
    tok.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "Tom has 3 apples, then 12 more. how many?"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2) and len(hf) == tok.vocab_size
    ids = tok.encode("12+7=", bos=True) + [tok.eos_id]
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids) == "12+7="
    assert load_tokenizer(tmp_path) == tok  # read back as the fast character tokenizer


def test_the_private_format_of_earlier_versions_still_loads(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"kind": LEGACY_KIND, "specials": list(SPECIALS),
                                                         "alphabet": "0123456789+-*="}))
    assert load_tokenizer(tmp_path) == CharTokenizer()


def test_sharded_folder_round_trip_through_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = build_model("micro", seed=1)
    path = save_model_dir(model, tok, tmp_path / "m", max_shard_bytes=100_000)
    shards = weight_files(path)
    assert len(shards) >= 3 and (path / WEIGHTS_INDEX_FILE).is_file()
    assert all(s.name.startswith("model-0000") for s in shards)
    assert (path / "generation_config.json").is_file()
    loaded, tok2 = load_model_dir(path)
    assert _same_weights(model, loaded) and tok2 == tok
    hf_model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    assert _same_weights(model, hf_model)
    assert AutoTokenizer.from_pretrained(str(path), local_files_only=True).encode("3+4=") == tok.encode("3+4=")
    names = {p.name for p in model_files(path)}
    assert {"config.json", "generation_config.json", "tokenizer.json", WEIGHTS_INDEX_FILE} <= names
    assert describe_model_dir(path)["weight_files"] == len(shards)


def test_a_folder_missing_a_shard_or_a_tensor_is_refused(tmp_path):
    model, tok = build_model("micro", seed=1)
    path = save_model_dir(model, tok, tmp_path / "m", max_shard_bytes=100_000)
    with pytest.raises(ModelFolderError):
        save_model_dir(model, tok, path)  # never overwrites
    shard = weight_files(path)[-1]
    shard.rename(shard.with_suffix(".bak"))
    with pytest.raises(ModelFolderError, match="lacks shard"):
        load_model_dir(path)
    shard.with_suffix(".bak").rename(shard)
    index = json.loads((path / WEIGHTS_INDEX_FILE).read_text())
    dropped = next(iter(index["weight_map"]))
    from safetensors.torch import load_file, save_file

    owner = path / index["weight_map"][dropped]
    tensors = load_file(str(owner))
    del tensors[dropped]
    save_file(tensors, str(owner), metadata={"format": "pt"})
    del index["weight_map"][dropped]
    (path / WEIGHTS_INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match="do not fit"):
        load_model_dir(path)  # transformers alone would fill the gap with random values


def test_a_bf16_folder_loads_in_bf16_or_as_asked(tmp_path):
    model, tok = build_model("micro", seed=2)
    path = save_model_dir(model, tok, tmp_path / "m", dtype=torch.bfloat16)
    assert compute_dtype(path) == torch.bfloat16
    loaded, _ = load_model_dir(path)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    master, _ = load_model_dir(path, dtype=torch.float32)
    assert next(master.parameters()).dtype == torch.float32
    expected = model.model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(master.model.embed_tokens.weight, expected)

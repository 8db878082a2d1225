"""What the trainer publishes: every version a standard, sharded model folder in the compute dtype
that transformers loads as it is, fp32 master weights behind bf16 compute, optimizer state kept
out of what workers fetch; and prompts through the chat template for instruct tokenizers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from models.folder import WEIGHTS_INDEX_FILE, _dtype_kwarg, save_model_dir, weight_files  # noqa: E402
from models.tiny import build_model  # noqa: E402
from models.tokenizer import TEXT_ALPHABET, CharTokenizer, HFTokenizer, load_tokenizer  # noqa: E402
from tasks.prompts import TaskConfig, assign_prompts, prompt_ids, reward  # noqa: E402
from trainer.checkpoint import OPTIMIZER_FILE, STATE_FILE, published_files, version_dir  # noqa: E402
from trainer.learner import Learner, LearnerConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from test_learner import make_batch  # noqa: E402

CONFIG = LearnerConfig(prompts_per_batch=4, group_size=4, keep_last=0, task_seed=7, max_shard_bytes=120_000)


def test_every_bf16_version_loads_with_transformers_and_keeps_fp32_masters(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = build_model("micro", seed=0)
    base = save_model_dir(model, tok, tmp_path / "base", dtype=torch.bfloat16)
    learner = Learner(CONFIG, base, tmp_path / "out")
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}  # master weights
    with torch.no_grad():
        learner.model.lm_head.weight.add_(1e-5)  # off the bf16 grid, as training moves the masters
    for _ in range(2):
        assert learner.step([make_batch(learner)]).trained
    learner.flush()
    masters = {k: v.clone() for k, v in learner.model.state_dict().items()}
    learner.close()
    for version in (0, 1, 2):
        folder = version_dir(tmp_path / "out", version)
        shards = weight_files(folder)
        assert len(shards) >= 2 and (folder / WEIGHTS_INDEX_FILE).is_file()
        assert json.loads((folder / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
        with safe_open(str(shards[0]), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                      **_dtype_kwarg("auto"))  # 4.x defaults to float32
        assert loaded.dtype == torch.bfloat16
        hf_tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        assert hf_tok.encode("3+4=", add_special_tokens=False) == tok.encode("3+4=")
        names = {p.name for p in published_files(folder)}
        assert OPTIMIZER_FILE not in names and STATE_FILE not in names
        assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
        assert {s.name for s in shards} <= names
    published = dict(loaded.state_dict())
    assert all(torch.equal(published[k], masters[k].to(torch.bfloat16)) for k in published)
    resumed = Learner(CONFIG, base, tmp_path / "out")
    assert resumed.version == 2
    # resumed from the fp32 masters kept with the optimizer state, not from the rounded weights
    assert all(torch.equal(resumed.model.state_dict()[k], v) for k, v in masters.items())
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in masters.values())
    resumed.close()


TEMPLATE = ("{% for message in messages %}({{ message['content'] }}){% endfor %}"
            "{% if add_generation_prompt %} ={% endif %}")


def chat_folder(tmp_path: Path) -> Path:
    """A tiny instruct-style model folder: the character vocabulary with a chat template."""
    from transformers import PreTrainedTokenizerFast

    char = CharTokenizer(alphabet=TEXT_ALPHABET)
    model, _ = build_model("micro", seed=0, tokenizer=char, max_positions=256)
    hf = PreTrainedTokenizerFast(tokenizer_object=char.to_tokenizers(), bos_token="<bos>", eos_token="<eos>",
                                 pad_token="<pad>")
    hf.chat_template = TEMPLATE
    return save_model_dir(model, HFTokenizer(hf), tmp_path / "chat")


def test_instruct_tokenizers_get_the_chat_template_and_free_text_rewards(tmp_path):
    folder = chat_folder(tmp_path)
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer) and tok.chat_template
    task = assign_prompts("w", 0, 7, 1, TaskConfig.from_spec("word_problems"))[0]
    ids = prompt_ids(task, tok)
    char = CharTokenizer(alphabet=TEXT_ALPHABET)
    assert ids == char.encode(f"({task.question}) =")  # the template around the question
    assert prompt_ids(task, char) == char.encode(task.prompt, bos=True)  # a base model: the raw prompt
    assert reward(task, f"so the answer is {task.answer}.", chat=True) == 1.0
    assert reward(task, f"so the answer is {task.answer}.") == 0.0  # a raw completion must be the number
    config = LearnerConfig(prompts_per_batch=2, group_size=2, keep_last=0, task_seed=7, max_new_tokens=4,
                           tasks=TaskConfig.from_spec("word_problems"))
    learner = Learner(config, folder, tmp_path / "out")
    assert learner.chat
    batch = make_batch(learner)
    assert learner._check(batch) is None  # the prompts it expects are the templated ones
    tasks = assign_prompts("w", 0, 7, 2, config.tasks)
    assert learner.rewards(batch) == [reward(tasks[r.row // 2], tok.decode(r.output_ids), chat=True)
                                      for r in batch.rollouts]
    learner.close()


@pytest.mark.parametrize("spec", ["word_problems", "arithmetic,word_problems"])
def test_word_problems_are_seeded_exact_and_readable_by_the_character_model(spec):
    config = TaskConfig.from_spec(spec)
    tasks = assign_prompts("w", 3, 1, 300, config)
    assert tasks == assign_prompts("w", 3, 1, 300, config)
    assert tasks != assign_prompts("w", 4, 1, 300, config)
    families = {t.family for t in tasks}
    assert families == set(config.families)
    char = CharTokenizer(alphabet=TEXT_ALPHABET)
    for t in tasks:
        char.encode(t.prompt)  # every character is in the alphabet
        assert t.answer_int >= 0 and reward(t, t.answer) == 1.0
    with pytest.raises(ValueError):
        TaskConfig.from_spec("poetry")

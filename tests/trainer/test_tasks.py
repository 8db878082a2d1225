import pytest

from trainer.tasks import Task, TaskConfig, assign_prompts, parse_answer, reward
from trainer.tokenizer import CharTokenizer, TEXT_ALPHABET, TokenizerError


def test_assign_prompts_is_deterministic_and_keyed():
    a = assign_prompts("worker-a", 3, 42, 16)
    assert a == assign_prompts("worker-a", 3, 42, 16)
    assert a[:4] == assign_prompts("worker-a", 3, 42, 4)
    assert a != assign_prompts("worker-b", 3, 42, 16)
    assert a != assign_prompts("worker-a", 4, 42, 16)
    assert a != assign_prompts("worker-a", 3, 43, 16)


def test_tasks_have_exact_answers():
    cfg = TaskConfig(max_operand=99, ops="+-*")
    for t in assign_prompts("w", 0, 1, 200, cfg):
        expr = t.prompt.rstrip("=")
        assert int(t.answer) == eval(expr)  # noqa: S307 - digits and one operator only
        assert t.prompt.endswith("=")


def test_reward_exact_and_malformed():
    task = Task("1+2=", "3")
    assert reward(task, "3") == 1.0
    assert reward(task, " 3 ") == 1.0
    assert reward(task, "4") == 0.0
    assert reward(task, "3x") == 0.0
    assert reward(task, "") == 0.0
    assert reward(Task("1-5=", "-4"), "-4") == 1.0
    assert parse_answer("12") == 12 and parse_answer("1 2") is None


def test_reward_partial_credit():
    cfg = TaskConfig(format_reward=0.1, closeness_reward=0.4)
    task = Task("5+5=", "10")
    assert reward(task, "9", cfg) == pytest.approx(0.1 + 0.4 * 0.9)
    assert reward(task, "40", cfg) == pytest.approx(0.1)
    assert reward(task, "10", cfg) == 1.0
    assert reward(task, "ten", cfg) == 0.0
    with pytest.raises(ValueError):
        TaskConfig(format_reward=0.5, closeness_reward=0.5)


def test_tokenizer_roundtrip_and_ids(tmp_path):
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ids = tok.encode("12+7=", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "12+7="
    assert tok.decode(tok.encode("3") + [tok.eos_id] + tok.encode("9")) == "3"
    assert ids == CharTokenizer().encode("12+7=", bos=True, eos=True)  # ids fixed by construction
    with pytest.raises(TokenizerError):
        tok.encode("x")
    wide = CharTokenizer(alphabet=TEXT_ALPHABET)
    wide.save(tmp_path)
    assert CharTokenizer.load(tmp_path) == wide
    assert CharTokenizer.load(tmp_path).encode("what is 2+2?") == wide.encode("what is 2+2?")

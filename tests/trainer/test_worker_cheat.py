"""The devnet's `other_model` cheat generates with the published model's architecture and
vocabulary but other weights, whatever the model (a text-alphabet model included, whose
vocabulary the default tiny model does not have)."""

from types import SimpleNamespace

import torch

from models.tiny import TEXT_POSITIONS, build_model
from models.tokenizer import TEXT_ALPHABET, CharTokenizer
from trainer.roles import WorkerRole

torch.set_num_threads(1)


def test_the_other_model_cheat_keeps_architecture_and_vocabulary_but_not_weights():
    published, tokenizer = build_model("micro", seed=0, tokenizer=CharTokenizer(alphabet=TEXT_ALPHABET),
                                       max_positions=TEXT_POSITIONS)
    worker = SimpleNamespace(_cheat_model=None)
    other = WorkerRole._other_model(worker, published)
    assert type(other) is type(published) and other.config.vocab_size == published.config.vocab_size
    assert WorkerRole._other_model(worker, published) is other  # built once
    theirs, ours = dict(other.named_parameters()), dict(published.named_parameters())
    assert theirs.keys() == ours.keys()
    assert all(theirs[n].shape == ours[n].shape for n in ours)
    assert any(not torch.equal(theirs[n], ours[n]) for n in ours)
    ids = torch.tensor([tokenizer.encode("what is 3 plus 4?")])
    with torch.no_grad():
        assert other(ids).logits.shape == published(ids).logits.shape

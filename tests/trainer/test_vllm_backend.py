"""The vLLM backend without vLLM: selection on a CPU machine, and every piece of the engine-side
logic (noise choice, persistent-batch bookkeeping, hidden-state capture, assembly) driven by an
emulation of vLLM's step loop over a transformers model."""

from __future__ import annotations

import dataclasses
import enum
from collections import deque, namedtuple
from types import SimpleNamespace

import pytest
import torch

from p2pnet.errors import ConfigError
from trainer import vllm_backend as vb
from trainer.model import forward_hidden_logits
from trainer.rollout import GenerationConfig, generate_batch
from trainer.tasks import TaskConfig, assign_prompts
from trainer.tokenizer import CharTokenizer
from verify.check import check_rollout
from verify.sampling import sample_tokens, token_logprobs

BatchUpdate = namedtuple("BatchUpdate", "batch_size removed added moved")


class Move(enum.Enum):  # stands in for vllm's MoveDirectionality
    UNIDIRECTIONAL = 0
    SWAP = 1


@dataclasses.dataclass(frozen=True)
class EosTokenizer(CharTokenizer):
    eos: int = 2

    @property
    def eos_id(self) -> int:
        return self.eos


# -- selection ------------------------------------------------------------------------------


def test_auto_and_torch_pick_the_torch_generator_here():
    assert not vb.vllm_status()[0]  # this machine: no vllm, no CUDA
    assert vb.select_generator("auto") is generate_batch
    assert vb.select_generator("torch") is generate_batch


def test_vllm_requested_but_missing_is_a_config_error():
    with pytest.raises(ConfigError, match="worker.backend") as info:
        vb.select_generator("vllm")
    assert "use 'torch' or 'auto'" in str(info.value)
    with pytest.raises(ConfigError, match="must be one of"):
        vb.select_generator("jax")


def test_auto_prefers_vllm_only_with_vllm_and_cuda(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(vb, "default_vllm_generator", lambda: sentinel)
    monkeypatch.setattr(vb, "vllm_status", lambda: (True, ""))
    assert vb.select_generator("auto") is sentinel and vb.select_generator("vllm") is sentinel
    monkeypatch.setattr(vb, "vllm_status", lambda: (False, "no CUDA device"))
    assert vb.select_generator("auto") is generate_batch


def test_module_imports_without_vllm_and_the_processor_class_is_lazy():
    with pytest.raises(vb.VllmUnavailable, match="not installed"):
        vb.ProofLogitsProcessor  # noqa: B018
    with pytest.raises(vb.VllmUnavailable):
        vb.VllmEngine().ensure(torch.nn.Linear(1, 1), None, version=0)


def test_worker_config_backend_field(tmp_path):
    from trainer.roles import WorkerConfig

    assert WorkerConfig(model_dir=tmp_path).backend == "auto"
    assert WorkerConfig(model_dir=tmp_path, backend="torch").backend == "torch"
    with pytest.raises(ConfigError, match="backend"):
        WorkerConfig(model_dir=tmp_path, backend="tpu")


# -- the pure pieces ------------------------------------------------------------------------


def test_choose_tokens_is_sample_tokens_and_token_logprobs():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 3
    rows, seed, pos = [0, 3, 7, 8, 20], 12345, 4
    for temp in (1.0, 0.7):
        tokens, logps = vb.choose_tokens(logits, [(seed, r, pos) for r in rows], [temp] * 5)
        expected = sample_tokens(logits, seed=seed, rows=rows, position=pos, temperature=temp)
        assert torch.equal(tokens, expected)
        assert torch.allclose(logps, token_logprobs(logits, expected, temp))
    forced = vb.forced_rows(tokens, 300, torch.float32)
    assert torch.equal(forced.argmax(-1), tokens) and torch.isinf(forced).sum() == 5 * 299


def test_core_tracks_removed_added_moved_in_order():
    store = vb.CaptureStore()
    core = vb.ProofSamplingCore(store)
    ours = lambda row: SimpleNamespace(extra_args=vb.request_extra("c", row, 9, 1.0))  # noqa: E731
    out = {r: [] for r in range(4)}
    core.update_state(BatchUpdate(3, [], [(0, ours(0), [], out[0]), (1, SimpleNamespace(extra_args=None), [], []),
                                          (2, ours(2), [], out[2])], []))
    assert {i: t.row for i, t in core.tracked.items()} == {0: 0, 2: 2}
    # slot 0 finishes, slot 1 (not ours) is replaced by row 3, then row 2 moves into the hole
    core.update_state(BatchUpdate(2, [0, 1], [(1, ours(3), [], out[3])], [(2, 0, Move.UNIDIRECTIONAL)]))
    assert {i: t.row for i, t in core.tracked.items()} == {0: 2, 1: 3}
    core.update_state(BatchUpdate(2, [], [], [(0, 1, Move.SWAP)]))
    assert {i: t.row for i, t in core.tracked.items()} == {0: 3, 1: 2}
    core.update_state(None)
    assert len(core.tracked) == 2


def test_apply_records_and_reports_a_hidden_mismatch():
    store = vb.CaptureStore()
    core = vb.ProofSamplingCore(store)
    out = [7, 7]  # two tokens already generated: position 2
    core.update_state(BatchUpdate(2, [], [(1, SimpleNamespace(extra_args=vb.request_extra("c", 5, 3, 1.0)),
                                           out)], []))
    logits = torch.randn(2, 50)
    before = logits.clone()
    store.pre_hook(None, (object(), torch.ones(2, 8)), {})
    after = core.apply(logits)
    assert torch.equal(after[0], before[0])  # not our request: untouched
    expected = sample_tokens(before[1:], seed=3, rows=[5], position=2, temperature=1.0)
    assert int(after[1].argmax()) == int(expected)
    token, logprob, hidden = store.records[("c", 5)][2]
    assert token == int(expected) and hidden.dtype == torch.bfloat16 and hidden.shape == (8,)
    assert logprob == pytest.approx(float(token_logprobs(before[1:], expected, 1.0)[0]))
    # position 2 only: the gaps at 0 and 1 are reported, never silently proven
    rows, errors = store.take("c")
    assert 5 not in rows and "gaps" in errors[0]
    core.apply(torch.randn(2, 50))  # no hidden stashed this step
    _, errors = store.take("c")
    assert "does not match" in errors[0]


def test_assemble_rows_checks_engine_against_records():
    h = torch.zeros(3, 4, dtype=torch.bfloat16)
    rec = {0: vb.RowRecord((5, 6, 2), (-1.0, -1.0, -1.0), h)}
    ok = vb.assemble_rows({0: [5, 6, 2]}, rec, [], eos_id=2, max_new_tokens=4)
    assert ok[0].stop_reason == "eos" and ok[0].output_ids == [5, 6, 2]
    assert vb.assemble_rows({0: [5, 6]}, rec, [], eos_id=2, max_new_tokens=4)[0].output_ids == [5, 6, 2]
    assert vb.assemble_rows({0: [5, 6, 2]}, rec, [], eos_id=9, max_new_tokens=3)[0].stop_reason == "length"
    with pytest.raises(vb.GenerationMismatch, match="differ"):
        vb.assemble_rows({0: [5, 7, 2]}, rec, [], eos_id=2, max_new_tokens=4)
    with pytest.raises(vb.GenerationMismatch, match="EOS or the limit"):
        vb.assemble_rows({0: [5, 6, 2]}, rec, [], eos_id=9, max_new_tokens=4)
    with pytest.raises(vb.GenerationMismatch, match="capture problems"):
        vb.assemble_rows({0: [5, 6, 2]}, rec, ["boom"], eos_id=2, max_new_tokens=4)
    with pytest.raises(vb.GenerationMismatch, match="nothing recorded"):
        vb.assemble_rows({1: [5]}, rec, [], eos_id=2, max_new_tokens=4)


# -- the whole loop against an emulated engine ----------------------------------------------


class EmulatedEngine:
    """vLLM's persistent batch and step loop, over a transformers model on CPU.

    At most `max_batch` requests run; a new request fills the lowest hole, remaining holes are
    closed by moving the highest live request down; every third step swaps slots 0 and 1; a new
    request's first step is a partial prefill whose token is thrown away (chunked prefill). The
    hook sits on lm_head (vLLM: on the logits_processor layer). Each step recomputes the full
    sequence (no KV cache), so hidden states come from a different code path than generate_rows.
    """

    def __init__(self, max_batch: int = 3) -> None:
        self.max_batch = max_batch
        self.store = vb.CaptureStore()
        self.core = vb.ProofSamplingCore(self.store)
        self.model = None

    def ensure(self, model, tokenizer, **_):
        if self.model is not model:
            self.store.hook_handle = None
            vb.install_capture_hook(model.lm_head, self.store)
            self.model = model
        return {}

    @torch.no_grad()
    def run(self, call, requests, *, seed, eos_id, config):
        waiting, slots, results, step = deque(requests), [], {}, 0
        removed, added, moved, partial = [], [], [], set()
        while waiting or any(s is not None for s in slots):
            holes = [i for i, s in enumerate(slots) if s is None]
            while waiting and (holes or len(slots) < self.max_batch):
                req = waiting.popleft()
                idx = holes.pop(0) if holes else len(slots)
                state = {"req": req, "out": []}
                slots[idx:idx + 1] = [state]
                params = SimpleNamespace(extra_args=vb.request_extra(call, req.row, seed, config.temperature))
                added.append((idx, params, list(req.prompt_ids), state["out"]))
                partial.add(idx)
            while holes and any(s is not None for s in slots[holes[0] + 1:]):
                last = max(i for i, s in enumerate(slots) if s is not None)
                slots[holes[0]], slots[last] = slots[last], None
                moved.append((last, holes.pop(0), Move.UNIDIRECTIONAL))
            while slots and slots[-1] is None:
                slots.pop()
            step += 1
            if step % 3 == 0 and len(slots) >= 2:
                slots[0], slots[1] = slots[1], slots[0]
                moved.append((0, 1, Move.SWAP))
                partial = {1 - i if i in (0, 1) else i for i in partial}
            self.core.update_state(BatchUpdate(len(slots), removed, added, moved))
            removed, added, moved = [], [], []
            hidden = []
            for i, s in enumerate(slots):
                ids = list(s["req"].prompt_ids) + s["out"]
                if i in partial and len(ids) > 1:
                    ids = ids[:-1]
                hidden.append(self.model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1])
            logits = self.core.apply(self.model.lm_head(torch.stack(hidden)).float())
            tokens = logits.argmax(-1).tolist()
            for i, s in enumerate(slots):
                if i in partial:
                    continue
                s["out"].append(tokens[i])
                if s["out"][-1] == eos_id or len(s["out"]) == config.max_new_tokens:
                    keep = s["out"][:-1] if s["req"].row % 2 and s["out"][-1] == eos_id else s["out"]
                    results[s["req"].row] = list(keep)  # odd rows: the engine leaves out the stop token
                    slots[i] = None
                    removed.append(i)
            partial = set()
        return results

    def take(self, call):
        return self.store.take(call)


def _run_both(model, tok, tasks, cfg):
    kw = dict(worker_id="w9", step=3, model_version=1, seed=11, config=cfg)
    torch_batch, _ = generate_batch(model, tok, tasks, **kw)
    vllm_batch, timing = vb.VllmGenerator(engine=EmulatedEngine())(model, tok, tasks, **kw)
    return torch_batch, vllm_batch, timing


def _validator_accepts(model, tok, batch):
    for r in batch.rollouts:
        verdict = check_rollout(lambda ids: forward_hidden_logits(model, ids), r.prompt_ids, r.output_ids,
                                r.proofs, seed=batch.sampling_seed, row=r.row, temperature=batch.temperature,
                                eos_token_id=tok.eos_id, max_new_tokens=batch.max_new_tokens)
        assert verdict.accepted, (r.row, verdict.reasons, verdict.detail)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_emulated_engine_matches_torch_generator_and_validator_accepts(tiny, temperature):
    model, _ = tiny
    tasks = assign_prompts("w9", 3, 11, 3, TaskConfig(max_operand=99))  # mixed prompt lengths
    cfg = GenerationConfig(group_size=3, max_new_tokens=6, temperature=temperature)
    probe, _, _ = _run_both(model, EosTokenizer(eos=10**6), tasks, cfg)
    # an EOS id the model really samples mid-sequence, so some rows stop early
    eos = next(r.output_ids[2] for r in probe.rollouts if len(set(r.output_ids)) > 1)
    tok = EosTokenizer(eos=eos)
    torch_batch, vllm_batch, timing = _run_both(model, tok, tasks, cfg)
    assert {r.stop_reason for r in vllm_batch.rollouts} == {"eos", "length"}
    for a, b in zip(torch_batch.rollouts, vllm_batch.rollouts):
        assert (a.row, a.prompt_ids, a.output_ids, a.stop_reason) == (b.row, b.prompt_ids, b.output_ids,
                                                                      b.stop_reason)
        assert b.logprobs == pytest.approx(list(a.logprobs), abs=1e-4)
        assert len(b.proofs) == len(a.proofs) == 1
    assert timing.n_tokens == vllm_batch.n_output_tokens and timing.proof_s > 0
    _validator_accepts(model, tok, vllm_batch)


def test_emulated_engine_long_rows_prove_every_chunk(tiny):
    model, _ = tiny
    tok = EosTokenizer(eos=10**6)
    cfg = GenerationConfig(group_size=2, max_new_tokens=40)
    torch_batch, vllm_batch, _ = _run_both(model, tok, assign_prompts("w9", 3, 11, 2), cfg)
    for a, b in zip(torch_batch.rollouts, vllm_batch.rollouts):
        assert a.output_ids == b.output_ids and len(b.proofs) == 2
    _validator_accepts(model, tok, vllm_batch)

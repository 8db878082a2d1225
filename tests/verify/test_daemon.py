"""A real validator process on loopback checks real rollouts and publishes verdicts over gossip.

The validator is `p2pnet peer start --role validator` (a child process) with a tiny random-init
model folder (trainer.model format). The worker side is an in-process peer of this test: it
publishes two signed submissions, one honest and one with a substituted token, and collects the
verdicts that come back on the verdicts topic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from p2pnet.control import call  # noqa: E402
from p2pnet.identity import Identity, SignatureChecker  # noqa: E402
from p2pnet.localnet import control_call, start_peer  # noqa: E402
from p2pnet.node import PeerConfig, run_node  # noqa: E402
from p2pnet.peertable import PeerTableConfig  # noqa: E402
from verify.assign import check_ticket  # noqa: E402
from verify.messages import (SUBMISSIONS_TOPIC, VERDICTS_TOPIC, Submission, Verdict, pack_u32,  # noqa: E402
                             submission_from_batch)

REPO = Path(__file__).resolve().parents[2]
TASK_SEED = 7
WORKER = Identity.from_seed_text("daemon-test-worker")


class VerdictCollector:
    topics = (VERDICTS_TOPIC,)
    kinds = (Verdict.KIND,)  # type: ignore[attr-defined]

    def __init__(self, out: trio.MemorySendChannel[Any]) -> None:
        self.out = out

    def start(self, now: float) -> list[Any]:
        return []

    def on_message(self, now: float, envelope: Any) -> list[Any]:
        self.out.send_nowait(envelope)
        return []

    def on_timer(self, now: float, key: str) -> list[Any]:
        return []

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Any]:
        return []


def _submissions(model_dir: Path) -> tuple[Submission, Submission]:
    from trainer.model import build_model, save_model_dir
    from trainer.rollout import GenerationConfig, generate_batch
    from trainer.tasks import assign_prompts

    model, tokenizer = build_model("tiny", seed=0)
    save_model_dir(model, tokenizer, model_dir)
    subs = []
    for step in (0, 1):
        batch, _ = generate_batch(model, tokenizer, assign_prompts(WORKER.peer_id, step, TASK_SEED, 2),
                                  worker_id=WORKER.peer_id, step=step, model_version=0, seed=TASK_SEED,
                                  config=GenerationConfig(group_size=2, max_new_tokens=6))
        subs.append(submission_from_batch(batch, model="tiny", prompts_per_submission=2,
                                          nonce=bytes([step + 1]) * 16))
    honest, other = subs
    first = other.rollouts[0]
    tokens = list(first.output)
    tokens[0] = (tokens[0] + 1) % tokenizer.vocab_size  # substitute the first generated token
    if tokens[0] == tokenizer.eos_id:
        tokens[0] = (tokens[0] + 1) % tokenizer.vocab_size
    tampered = replace(other, rollouts=(replace(first, output_ids=pack_u32(tokens)),) + other.rollouts[1:])
    return honest, tampered


async def _worker_side(root: Path, bootstrap: str, validator_dir: Path, subs: tuple[Submission, ...]) -> list[Any]:
    send, receive = trio.open_memory_channel[Any](16)
    config = PeerConfig(data_dir=root / "w", bootstrap=(bootstrap,))
    table = PeerTableConfig(heartbeat_interval_s=0.5, expiry_s=5.0)
    async with trio.open_nursery() as nursery:
        node = await nursery.start(lambda task_status: run_node(config, peertable_config=table, identity=WORKER,
                                                                 task_status=task_status))
        await nursery.start(node.run_core, VerdictCollector(send), "collector")
        with trio.fail_after(30):  # until the validator has heard our heartbeat (gossip works both ways)
            while WORKER.peer_id not in {p["peer_id"] for p in (await call(validator_dir, {"cmd": "status"}))["peers"]}:
                await trio.sleep(0.1)
        for sub in subs:
            await node.publish(SUBMISSIONS_TOPIC, sub)
        verdicts = []
        with trio.fail_after(60):
            while len(verdicts) < len(subs):
                verdicts.append(await receive.receive())
        nursery.cancel_scope.cancel()
    return verdicts


def test_validator_process_checks_submissions_and_publishes_verdicts(tmp_path: Path) -> None:
    honest, tampered = _submissions(tmp_path / "model")
    config = tmp_path / "validator.toml"
    config.write_text(
        "[validator]\n"
        f'model_path = "{tmp_path / "model"}"\n'
        f'workers = ["{WORKER.peer_id}"]\n'
        f"task_seed = {TASK_SEED}\n"
        "claim_window_s = 0.0\n"
    )
    validator = start_peer("validator", tmp_path / "v", roles=["validator"],
                           extra_args=["--config", str(config), "--heartbeat-interval-s", "0.5"],
                           env={"PYTHONPATH": str(REPO)})
    try:
        validator.wait_ready(60)
        envelopes = trio.run(_worker_side, tmp_path, validator.addr, validator.data_dir, (honest, tampered))
        status = control_call(validator.data_dir, {"cmd": "validator.status"})["validator"]
        cli = subprocess.run([sys.executable, "-m", "p2pnet", "validator", "status", "--data-dir",
                              str(validator.data_dir), "--json"], capture_output=True, text=True, timeout=30,
                             cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    finally:
        code = validator.stop()
    assert code == 0, validator.log_path.read_text()[-3000:]

    by_step = {e.body.step: e for e in envelopes}
    assert set(by_step) == {0, 1}
    for env in envelopes:
        assert env.sender == validator.peer_id and env.body.worker == WORKER.peer_id
        check_ticket(SignatureChecker(), env.sender_bytes, env.body.submission_id, env.body.validator_ticket)
        assert env.body.checked_rollouts == 4
    assert by_step[0].body.accepted and by_step[0].body.reasons == ()
    assert not by_step[1].body.accepted
    assert "row0:sampling_mismatch" in by_step[1].body.reasons
    assert (status["seen"], status["checked"], status["accepted"], status["rejected"]) == (2, 2, 1, 1)
    assert status["check_s_mean"] > 0 and status["models_cached"] == [str(tmp_path / "model")]
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["validator"]["checked"] == 2


# -- configuration and model source (no processes) ------------------------------------------------


def test_validator_flags_fill_the_section_and_bad_values_name_the_field() -> None:
    from p2pnet.cli import build_parser
    from p2pnet.config import from_mapping
    from p2pnet.errors import ConfigError
    from verify.cli import validator_section
    from verify.daemon import ValidatorConfig

    args = build_parser().parse_args(["validator", "start", "--data-dir", "/tmp/x", "--model", "/m",
                                      "--sample-rate", "0.25", "--allow-worker", WORKER.peer_id])
    section = validator_section(args, {"validator": {"sample_rate": 0.5, "max_queue": 4}})
    config = from_mapping(ValidatorConfig, section, "validator")
    assert (config.sample_rate, config.max_queue, config.model_path, config.workers) == \
        (0.25, 4, Path("/m"), (WORKER.peer_id,))
    with pytest.raises(ConfigError, match="validator.sample_rate"):
        from_mapping(ValidatorConfig, {"sample_rate": 1.5}, "validator")
    with pytest.raises(ConfigError, match="validator.thresholds"):
        from_mapping(ValidatorConfig, {"thresholds": {"bogus": 1}}, "validator")


def test_model_source_prefers_checkpoint_versions_and_keeps_an_lru(tmp_path: Path) -> None:
    from verify.daemon import LoadedModel, ModelSource, ModelUnavailable

    (tmp_path / "ckpt" / "v3").mkdir(parents=True)
    loads: list[Path] = []

    def loader(folder: Path, device: str) -> LoadedModel:
        loads.append(folder)
        return LoadedModel(lambda ids: (None, None), None, 2, 17, str(folder))

    source = ModelSource(tmp_path / "base", tmp_path / "ckpt", cache_size=1, loader=loader)
    assert source(3).source == str(tmp_path / "ckpt" / "v3")
    assert source(4).source == str(tmp_path / "base")  # no v4 folder: the fixed model
    source(4)
    source(3)
    assert loads == [tmp_path / "ckpt" / "v3", tmp_path / "base", tmp_path / "ckpt" / "v3"]
    with pytest.raises(ModelUnavailable):
        ModelSource(None, tmp_path / "ckpt")(5)


def test_relay_model_source_swaps_weights_into_the_evicted_model(tmp_path: Path) -> None:
    import torch

    from relay.store import ChunkStore
    from trainer.model import build_model, save_model_dir, save_weights, snapshot_state
    from verify.daemon import RelayModelSource

    publisher = Identity.from_seed_text("trainer")
    base = save_model_dir(*build_model("micro", seed=0), tmp_path / "base")
    store = ChunkStore(tmp_path / "store", budget_bytes=10**9, trusted_publishers=[publisher.peer_id], fsync=False)
    for version, seed in ((0, 0), (1, 1)):
        weights = tmp_path / f"v{version}.safetensors"
        save_weights(snapshot_state(build_model("micro", seed=seed)[0]), weights)
        store.publish_files(publisher, [weights], model="micro", version=version, previous_version=version - 1,
                            now_s=1_800_000_000.0)
    source = RelayModelSource(base, store, cache_size=1)
    first = source(0)
    ids = [1, 5, 6, 7]
    _, logits0 = first.forward(ids)
    second = source(1)
    assert second.module is first.module  # the architecture was not built again
    _, logits1 = second.forward(ids)
    fresh = RelayModelSource(base, store, cache_size=1)(1)
    assert fresh.module is not second.module
    assert torch.equal(logits1, fresh.forward(ids)[1]) and not torch.equal(logits0, logits1)
    assert source.cached() == ["v1"]

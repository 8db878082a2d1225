"""The worker and trainer roles: the thin trio shells that put the trainer package on the network.

`WorkerRole` follows new checkpoint versions through the relay role, generates its assigned
prompts' rollouts with proofs (in a worker thread), signs and gossips them as a `Submission`,
and never runs more than `async_level` versions behind the newest it knows. A version that does
not load (a chunk rotten on disk, files safetensors refuses, tensors that do not fit the model)
is rejected: logged, listed in `rejected_versions`, and the worker keeps the version it has; it
tries that version again only once its files change (the relay fetched them again).
`TrainerRole` runs the `Intake` core (in the role's own nursery, until the peer stops: after the
last step too), trains (GRPO, `trainer.learner`, or with `ranks` above 1 a torchrun group of
FSDP2 ranks, `trainer.ranks`) only on batches validators accepted, and publishes every new
version through the relay role; the checkpoint write and the publish run beside the next step,
never in its way. Its intake's verification memory (bans, failed batches, the sibling index)
is kept in `out_dir/intake_state.json` and restored at start (`trainer.intake_state`: saved at
once after a failed verdict or ban, within seconds after other changes, and at shutdown), so
that a restart does not let workers the validators banned pass unchecked; a damaged file stops
the start unless `discard_damaged_intake_state` is set. The batches it kept come back with it
(`trainer.intake_kept`), and a restarted trainer asks the workers and validators it meets for
what they sent while it was down (`verify.recall`): a worker answers with the frames of its last
few submissions, so a step whose batches the trainer missed is still trained. Both need the
relay role in the same peer.

A worker's `byzantine` setting exists for devnets and tests that must show cheaters caught: it
makes the worker lie on purpose, and the worker says so loudly in its log and status.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from p2pnet.config import from_mapping, validated
from p2pnet.errors import ConfigError
from p2pnet.peertable import PEER_TABLE_CORE
from models.weights import load_version
from relay.loader import LOAD_FAILURES, RejectedVersions
from tasks.prompts import check_spec
from trainer.intake import BatchesSkewed, Intake, IntakeConfig
from trainer.intake_state import INTAKE_STATE_FILE, IntakeStateFile, load_into
from trainer.metricsfile import METRICS_FILE, MetricsFile, tokens_of
from verify.messages import Recalled
from trainer.worker_frames import SUBMITTED_DIR, load as load_frames, save as save_frame
from verify.recall import WORKER_KEPT, RecallCore
from verify.reputation import BatchInvalidated, WorkerBanned
from verify.validator import Penalise

log = logging.getLogger(__name__)
SUBMITTED_KEPT = 20  # a worker's latest batches its status shows (it counts them all in `totals`)
RECALL_FOR_S = 120.0  # a restarted trainer asks the workers and validators it meets this long after its start
RECALL_TICK_S = 1.0  # and looks for peers it has not asked this often
RECALL_PER_TICK = 64  # asking at most this many each time
RECALL_ANSWER_S = 30.0  # and takes answers this long after it stopped asking
RECALL_CORE = "recall"  # the worker's core that answers a restarted trainer
BYZANTINE_MODES = ("", "substitute_tokens", "other_model")
WORKER_BACKENDS = ("auto", "torch", "vllm")  # trainer.vllm_backend.select_generator


def _relay(node: Any, role: str) -> Any:
    relay = node.roles.get("relay")
    if relay is None:
        raise ConfigError("peer.roles", f"the {role} role needs the relay role in the same peer (--role relay)")
    return relay


@validated
@dataclass(frozen=True)
class WorkerConfig:
    model_dir: Path  # the base model folder (architecture, tokenizer); weights come from checkpoints
    model_name: str = "tiny"  # the model name written into submissions (the trainer's model_name)
    task_seed: int = 0  # the network's task seed (the trainer's task_seed)
    tasks: str = "arithmetic"  # task families, comma-separated: arithmetic, word_problems (as the trainer's)
    prompts_per_batch: int = 16  # prompts per submitted batch (as the trainer's)
    group_size: int = 8  # samples per prompt (as the trainer's)
    max_new_tokens: int = 3  # tokens generated per sample at most (as the trainer's)
    temperature: float = 1.0  # sampling temperature (as the trainer's)
    async_level: int = 2  # generate with a version at most this many steps behind the newest
    byzantine: str = ""  # devnets and tests only: substitute_tokens or other_model makes this worker cheat
    backend: str = "auto"  # auto: vLLM when vllm imports and CUDA is available, else torch

    def check(self) -> dict[str, str]:
        problems = {}
        if self.byzantine not in BYZANTINE_MODES:
            problems["byzantine"] = f"must be one of {BYZANTINE_MODES}"
        if self.backend not in WORKER_BACKENDS:
            problems["backend"] = f"must be one of {WORKER_BACKENDS}"
        if self.prompts_per_batch < 1 or self.group_size < 2:
            problems["group_size" if self.group_size < 2 else "prompts_per_batch"] = "too small"
        if self.async_level < 0:
            problems["async_level"] = "must be >= 0"
        if check_spec(self.tasks):
            problems["tasks"] = check_spec(self.tasks)
        return problems


class WorkerRole:
    def __init__(self, node: Any, section: dict[str, Any]) -> None:
        self.node = node
        self.config = from_mapping(WorkerConfig, section, "worker")
        self.relay = _relay(node, "worker")
        self.submitted: deque[dict[str, Any]] = deque(maxlen=SUBMITTED_KEPT)  # the latest batches (status)
        self.totals = {"batches": 0, "rollouts": 0, "tokens": 0, "generate_s": 0.0, "proof_s": 0.0}  # metrics
        self.version = -1
        self.loaded: tuple[Any, Any] | None = None  # the model and tokenizer of `version`
        self.backend_used = "torch"  # what generated the last batch (trainer.vllm_backend.select_generator)
        self.rejected = RejectedVersions()
        self._cheat_model: Any = None  # byzantine = other_model: the other weights it generates with
        self.recall = RecallCore(self.relay.config.trusted_publishers)  # our frames, for a restarted trainer
        # our last submissions, kept across our own restarts: never a step twice (`trainer.worker_frames`)
        self.frames_dir = node.config.data_dir / SUBMITTED_DIR
        self.resumed_step = self.resumed_version = -1  # the newest step we submitted before, and its version
        for step, frame, version in load_frames(self.frames_dir, node.peer_id):
            self.recall.answers.sent(node.peer_id, step, Recalled(frame))
            self.resumed_step, self.resumed_version = step, version
        if self.config.byzantine:
            log.error("worker.byzantine=%s: this worker CHEATS on purpose (devnet/test setting)",
                      self.config.byzantine)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Generate and submit a batch per step; answer a restarted trainer's `Recall` with the
        frames of the last few (`verify.recall`: workers never submit a step twice)."""
        async with trio.open_nursery() as nursery:  # the answering core lives as long as the role
            await nursery.start(self.node.run_core, self.recall, RECALL_CORE)
            await self._work(task_status)

    async def _work(self, task_status: trio.TaskStatus[None]) -> None:
        from trainer.rollout import GenerationConfig

        cfg = self.config
        generation = GenerationConfig(group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                                      temperature=cfg.temperature)
        task_status.started()
        last_step = -1
        while True:
            await self.relay.wait_for_version(max(0, last_step + 1 - cfg.async_level))
            load_s = await self.switch_version()
            if self.loaded is None:  # every complete version was rejected: wait for a new or re-fetched one
                await self.relay.watcher.wait_change()
                continue
            model, tokenizer = self.loaded
            step = max(last_step + 1, self.relay.watcher.latest)
            if step <= self.resumed_step and self.resumed_version <= self.relay.watcher.latest:
                # sent before our restart, in this run (the network has the version we made it with; a
                # new run starts its versions again): validators refuse a second one, so the next
                log.info("worker: step %d was submitted before this start: going on from step %d", step,
                         self.resumed_step + 1)
                step = self.resumed_step + 1
            if step - self.version > cfg.async_level:
                # the newer versions did not load here: a batch of ours would be refused (`stale_version`)
                log.warning("worker: version %d is the newest that loads here, more than async_level (%d) behind "
                            "step %d: nothing it makes could be trained on; waiting for a newer version",
                            self.version, cfg.async_level, step)
                await self.relay.watcher.wait_change()
                continue
            started = time.monotonic()
            files = self._version_files()
            batch, timing = await trio.to_thread.run_sync(self._generate, model, tokenizer, step, generation, files)
            frame = await self._submit(batch)
            if frame is not None:
                self.recall.answers.sent(self.node.peer_id, step, Recalled(frame))
                await trio.to_thread.run_sync(save_frame, self.frames_dir, step, frame, WORKER_KEPT)
            last_step = step
            for key, value in (("batches", 1), ("rollouts", len(batch.rollouts)), ("tokens", batch.n_output_tokens),
                               ("generate_s", timing.generate_s), ("proof_s", timing.proof_s)):
                self.totals[key] += value
            self.submitted.append({"step": step, "model_version": self.version, "rows": len(batch.rollouts),
                                   "tokens": batch.n_output_tokens, "generate_s": round(timing.generate_s, 4),
                                   "proof_s": round(timing.proof_s, 4), "wall_s": round(time.monotonic() - started, 3),
                                   "load_s": round(load_s, 3)})
            # one batch per step: wait for the trainer to move on before the next one
            await self.relay.wait_for_version(step + 1)

    async def switch_version(self) -> float:
        """Load the newest complete version not rejected, if it is newer than ours (or we have
        none); the seconds spent loading. A version that does not load is rejected and we keep
        ours (or try the next older one when we have none)."""
        store = self.relay.store
        for version in reversed(self.relay.watcher.complete_versions()):
            if self.loaded is not None and version <= self.version:
                return 0.0
            try:
                stamp = store.version_stamp(version)
            except LOAD_FAILURES as exc:  # collected meanwhile
                log.info("worker: version %d is gone: %s", version, exc)
                continue
            if self.rejected.blocked(version, stamp) is not None:
                continue  # the same files that failed: not again
            loading = time.monotonic()
            try:
                self.loaded = await trio.to_thread.run_sync(load_version, self.config.model_dir, store, version,
                                                            self.loaded)
            except LOAD_FAILURES as exc:
                self.rejected.reject(version, stamp, str(exc), time.time())
                log.warning("worker: checkpoint version %d does not load (%s); %s", version, exc,
                            f"keeping version {self.version}" if self.loaded is not None else "no version loaded yet")
                continue
            self.rejected.loaded(version)
            self.version = version
            return time.monotonic() - loading
        return 0.0

    def _version_files(self) -> tuple[Path, ...]:
        """The verified files of the loaded version (an engine with weights of its own streams
        them); () when the store no longer holds it (the engine then takes the model's)."""
        try:
            return tuple(self.relay.store.version_files(self.version))
        except LOAD_FAILURES:
            return ()

    def _generate(self, model: Any, tokenizer: Any, step: int, generation: Any,
                  files: tuple[Path, ...] = ()) -> tuple[Any, Any]:
        from tasks.prompts import TaskConfig, assign_prompts
        from trainer.vllm_backend import select_generator

        generate_batch = select_generator(self.config.backend)
        self.backend_used = "vllm" if "vllm" in generate_batch.__module__ else "torch"  # declared in submissions
        tasks = assign_prompts(self.node.peer_id, step, self.config.task_seed, self.config.prompts_per_batch,
                               TaskConfig.from_spec(self.config.tasks))
        if self.config.byzantine == "other_model":
            model, files = self._other_model(model), ()
        batch, timing = generate_batch(model, tokenizer, tasks, worker_id=self.node.peer_id, step=step,
                                       model_version=self.version, seed=self.config.task_seed, config=generation,
                                       weight_files=files)
        if self.config.byzantine == "substitute_tokens":
            batch = _substitute_answers(batch, tokenizer, self.config.tasks)
        return batch, timing

    def _other_model(self, model: Any) -> Any:
        """The cheat: the published model's architecture and vocabulary with other weights (a
        seeded random init), so its rollouts look well-formed; built once."""
        import torch

        if self._cheat_model is None:
            with torch.random.fork_rng():
                torch.manual_seed(12345)
                other = type(model)(model.config).to(dtype=next(model.parameters()).dtype)
            self._cheat_model = other.eval()
        return self._cheat_model

    async def _submit(self, batch: Any) -> bytes | None:
        from verify.messages import SUBMISSIONS_TOPIC, Stack, stack_of, submission_from_batch

        stack = stack_of(self.loaded[0], self.backend_used) if self.loaded is not None else None
        if stack is not None and self.backend_used == "vllm":  # vLLM runs its own copy on the GPU
            stack = Stack(stack.dtype, "vllm", "cuda")
        submission = submission_from_batch(batch, model=self.config.model_name,
                                           prompts_per_submission=self.config.prompts_per_batch,
                                           nonce=os.urandom(16), **({"stack": stack} if stack else {}))
        return await self.node.publish(SUBMISSIONS_TOPIC, submission)  # the frame sent

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "byzantine": self.config.byzantine, "submitted": list(self.submitted),
                "batches_submitted": self.totals["batches"], "rejected_versions": self.rejected.to_json()}


def _substitute_answers(batch: Any, tokenizer: Any, spec: str = "arithmetic") -> Any:
    """The cheat: replace each sequence's first generated token by the correct answer's first digit."""
    from dataclasses import replace

    from tasks.prompts import TaskConfig, assign_prompts

    tasks = assign_prompts(batch.worker_id, batch.step, batch.seed, batch.n_prompts, TaskConfig.from_spec(spec))
    rollouts = []
    for r in batch.rollouts:
        answer = tokenizer.encode(str(tasks[r.row // batch.group_size].answer))
        out = list(r.output_ids)
        out[0] = answer[0]
        rollouts.append(replace(r, output_ids=tuple(out)))
    return replace(batch, rollouts=tuple(rollouts))


@validated
@dataclass(frozen=True)
class TrainerConfig:
    model_dir: Path  # the starting model folder (version 0)
    out_dir: Path  # checkpoint versions are written here as v{version}/ (training resumes from the newest), and the intake's bans, sibling index and contributors leaderboard as intake_state.json, the batches it keeps in intake_batches/
    model_name: str = "tiny"  # the model name in manifests and submissions
    steps: int = 20  # train this many steps, then stop training (the peer keeps serving)
    batches_per_step: int = 0  # 0: wait until every live, unbanned worker's batch is decided
    step_timeout_s: float = 20.0  # after the first admitted batch, wait at most this long for the others
    lr: float = 3e-3  # AdamW learning rate
    task_seed: int = 0  # the network's task seed (workers and validators must use the same)
    tasks: str = "arithmetic"  # task families, comma-separated: arithmetic, word_problems (workers and validators must use the same)
    max_shard_bytes: int = 1_000_000_000  # published versions are safetensors shards of at most this many bytes
    prompts_per_batch: int = 16  # prompts per worker batch
    group_size: int = 8  # samples per prompt (GRPO group)
    max_new_tokens: int = 3  # tokens generated per sample at most
    temperature: float = 1.0  # sampling temperature workers must use
    async_level: int = 2  # batches made by a policy at most this many versions old are trained on
    sample_rate: float = 1.0  # share of submissions validators check (batches checked by none wait for it)
    ban_after_failures: int = 2  # rejected batches after which a worker's batches are refused
    ban_min_validators: int = 1  # distinct validators whose rejections a ban needs (2: one lying validator cannot ban an honest worker)
    ban_s: float = 0.0  # how long a ban lasts (0: for good)
    workers: tuple[str, ...] = ()  # peer ids whose batches are taken (empty: any peer whose heartbeat says worker)
    validators: tuple[str, ...] = ()  # peer ids whose claims and verdicts count (empty: any peer whose heartbeat says validator; an open network should list them, as its validators do)
    keep_last: int = 0  # checkpoint versions kept in out_dir (0: async_level + 2); older ones are deleted
    keep_optimizer_states: int = 1  # versions that keep optimizer.pt (0: all kept); resuming needs the newest
    discard_damaged_intake_state: bool = False  # an unreadable out_dir/intake_state.json (bans, sibling index, leaderboard): start without it instead of refusing to start
    ranks: int = 1  # learner processes: above 1, a torchrun group of FSDP2 ranks (one GPU each where CUDA is, else CPU) with DCP checkpoints in out_dir/sharded/

    def intake_config(self) -> IntakeConfig:
        """What the trainer's intake believes: whose batches, whose verdicts, and how bans go."""
        return IntakeConfig(sample_rate=self.sample_rate, async_level=self.async_level,
                            ban_after_failures=self.ban_after_failures, ban_min_validators=self.ban_min_validators,
                            ban_s=self.ban_s, workers=tuple(self.workers), validators=tuple(self.validators))

    def check(self) -> dict[str, str]:
        problems = {}
        if self.ban_min_validators < 1:
            problems["ban_min_validators"] = "must be >= 1"
        if self.ranks < 1:
            problems["ranks"] = "must be >= 1"
        if self.keep_last and self.keep_last <= self.async_level:
            problems["keep_last"] = f"must be 0 or exceed async_level ({self.async_level})"
        if self.keep_optimizer_states < 0:
            problems["keep_optimizer_states"] = "must be >= 0"
        if self.steps < 1:
            problems["steps"] = "must be >= 1"
        if self.batches_per_step < 0:
            problems["batches_per_step"] = "must be >= 0"
        if not self.step_timeout_s > 0:
            problems["step_timeout_s"] = "must be > 0"
        if check_spec(self.tasks):
            problems["tasks"] = check_spec(self.tasks)
        if self.max_shard_bytes < 1:
            problems["max_shard_bytes"] = "must be >= 1"
        return problems


class TrainerRole:
    def __init__(self, node: Any, section: dict[str, Any]) -> None:
        self.node = node
        self.config = from_mapping(TrainerConfig, section, "trainer")
        self.relay = _relay(node, "trainer")
        cfg = self.config
        self.intake = Intake(cfg.intake_config(), node.peer_id, node.peertable)
        # what the validators' refusals rely on: bans and the sibling index outlive a restart
        state_path = cfg.out_dir / INTAKE_STATE_FILE
        self.restored = load_into(self.intake, state_path, trio.current_time(), time.time(),
                                  discard_damaged=cfg.discard_damaged_intake_state)
        if self.restored:
            log.info("trainer: intake state restored from %s (%d banned workers, %d batches kept)", state_path,
                     len(self.intake.reputation.banned(trio.current_time())), len(self.intake.batches))
        self.intake_state = IntakeStateFile(state_path, self.intake)
        self.history: list[dict[str, Any]] = []
        self.published_at: dict[int, float] = {}
        self.publish_timing: dict[int, dict[str, float]] = {}  # version -> write_s, publish_s
        self.started_at = 0.0
        self.version = -1
        self.done = False
        self.learner: Any = None
        self.metrics_file = MetricsFile(node.config.data_dir / METRICS_FILE)  # one line per step

    def _build_learner(self) -> Any:
        import torch

        torch.set_num_threads(1)
        from tasks.prompts import TaskConfig
        from trainer.learner import Learner, LearnerConfig

        cfg = self.config
        config = LearnerConfig(lr=cfg.lr, async_level=cfg.async_level, task_seed=cfg.task_seed,
                               prompts_per_batch=cfg.prompts_per_batch, group_size=cfg.group_size,
                               temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                               keep_last=cfg.keep_last or cfg.async_level + 2,
                               keep_optimizer_states=cfg.keep_optimizer_states,
                               max_shard_bytes=cfg.max_shard_bytes, tasks=TaskConfig.from_spec(cfg.tasks))
        if cfg.ranks > 1:
            from trainer.ranks import GroupConfig, LearnerGroup

            return LearnerGroup(config, cfg.model_dir, cfg.out_dir, GroupConfig(ranks=cfg.ranks))
        return Learner(config, cfg.model_dir, cfg.out_dir)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Train `steps` steps, then keep the intake running (it still hears holders, verdicts
        and submissions, for the status and the leaderboard) until the peer stops."""
        self.node.on_event(self._on_event)
        try:
            async with trio.open_nursery() as cores:
                if not self.restored:
                    self.intake_state.save()  # so that a crash from now on restarts as a restart (`_recall`)
                runner = await cores.start(self.node.run_core, self.intake, "intake")
                cores.start_soon(self.intake_state.keep)
                await self._train(runner, task_status)
        finally:
            self.intake_state.save()  # a clean stop loses nothing of it

    async def _train(self, runner: Any, task_status: trio.TaskStatus[None]) -> None:
        self.started_at = trio.current_time()
        self.learner = await trio.to_thread.run_sync(self._build_learner)
        self.version = self.learner.version
        from trainer.checkpoint import trained_keys  # (torch: imported where a learner is built, not by every peer)

        # batches trained into a version the last run did not write, or into one it wrote but did not mark
        self.intake.resume_at(self.version, trained_keys(self.config.out_dir, self.version))
        recalling = trio.CancelScope()  # ends with training: steps past the last need nothing
        async with trio.open_nursery() as nursery:
            if self.restored or self.version > 0:  # a restart: what was sent while we were down is asked for
                nursery.start_soon(self._recall, max(0, self.version - self.config.async_level), recalling)
            await self._publish(self.version)
            task_status.started()
            while self.version < self.config.steps:
                gathering = trio.current_time()
                batches = await self._gather(runner)
                gather_s = trio.current_time() - gathering
                stats = await trio.to_thread.run_sync(self.learner.step, [_to_batch(b) for b in batches])
                refused = set(stats.refused)  # validators accepted them, the learner's rules did not:
                self.intake.mark_refused([b for i, b in enumerate(batches) if i in refused])  # never offered again
                self.intake.mark_trained([b for i, b in enumerate(batches) if i not in refused] if stats.trained else [],
                                         stats.version)
                self._record(stats, batches, gather_s)
                if stats.trained:
                    self.version = stats.version
                    nursery.start_soon(self._flush_and_publish, stats.version)
            self.done = True
            recalling.cancel()
            log.info("trainer: reached %d steps", self.config.steps)
        await trio.to_thread.run_sync(self.learner.close)  # a learner group's ranks checkpoint and exit

    async def _recall(self, since_step: int, scope: trio.CancelScope) -> None:
        """Ask each worker and validator we meet within `RECALL_FOR_S` of the restart, once, for
        what it sent for steps >= `since_step` (`verify.recall`); the answers reach the intake,
        which takes workers' frames only from those asked, until `RECALL_ANSWER_S` after."""
        from p2pnet.core import Send
        from verify.messages import Recall

        asked: set[str] = set()
        until = trio.current_time() + RECALL_FOR_S
        with scope:
            try:
                while trio.current_time() < until:
                    peers = [e.peer_id for e in self.node.peertable.with_role("worker")
                             + self.node.peertable.with_role("validator")]
                    for peer in [p for p in peers if p not in asked][:RECALL_PER_TICK]:  # the outbox is shared
                        asked.add(peer)
                        self.intake.asking(peer)
                        self.node.carry_out("intake", Send(peer, Recall(since_step)))
                    await trio.sleep(RECALL_TICK_S)
                await trio.sleep(RECALL_ANSWER_S)  # the last ones asked have answered
            finally:
                self.intake.asking_done()
        log.info("trainer: asked %d workers and validators for what they sent for steps >= %d: %d batches came "
                 "back that way", len(asked), since_step, self.intake.recalled)

    async def _gather(self, runner: Any) -> list[Any]:
        """Admitted batches for this step, once every live worker's batch is decided (or on timeout)."""
        first_at = None
        while True:
            now = trio.current_time()
            ready = self.intake.admissible(now, self.version)
            if self.config.batches_per_step and len(ready) >= self.config.batches_per_step:
                return ready
            if ready and not self.config.batches_per_step and not self.intake.undecided_workers(now, self.version):
                return ready
            if ready and first_at is None:
                first_at = now
            if first_at is not None and now - first_at >= self.config.step_timeout_s:
                return ready
            await trio.sleep(0.05)

    async def _flush_and_publish(self, version: int) -> None:
        flushing = trio.current_time()
        await trio.to_thread.run_sync(self.learner.flush)
        # only now that `version` is on disk: forgotten before, a crash in the write left the
        # restarted learner a step its batches were gone for (`Intake.resume_at` needs them)
        self.intake.forget_before_step(version - self.config.async_level)
        publishing = trio.current_time()
        await self._publish(version)
        self.publish_timing[version] = {"write_s": round(publishing - flushing, 4),
                                        "publish_s": round(trio.current_time() - publishing, 4)}

    async def _publish(self, version: int) -> None:
        from trainer.checkpoint import published_files, version_dir

        if self.relay.watcher.is_complete(version):
            self.intake.published(version, self.published_at.setdefault(version, trio.current_time()))
            return  # published before a restart: the relay already holds and announces it
        # the model folder (config, generation config, tokenizer, shards, index); never the optimizer state
        paths = published_files(version_dir(self.config.out_dir, version))
        await self.relay.publish(paths, model=self.config.model_name, version=version,
                                 previous_version=version - 1)
        self.published_at[version] = trio.current_time()
        self.intake.published(version, self.published_at[version])

    def _record(self, stats: Any, batches: list[Any], gather_s: float = 0.0) -> None:
        step = stats.version - 1 if stats.trained else self.version
        accepted, rejected = self.intake.step_counts(step)
        self.history.append({
            "step": step, "trained": stats.trained, "version": stats.version,
            "reward_mean": round(stats.reward_mean, 4), "accuracy": round(stats.accuracy, 4),
            "batches": len(batches), "accepted_batches": accepted, "rejected_batches": rejected,
            "learner_rejected": stats.rejected, "loss": round(stats.loss, 5), "train_s": round(stats.train_s, 4),
            "workers": sorted({b.worker for b in batches}),
            "gather_s": round(gather_s, 4), "t_s": round(trio.current_time() - self.started_at, 3),
            "tokens": tokens_of(batches),
        })
        row = self.history[-1]
        wall_s = row["gather_s"] + row["train_s"]
        self.metrics_file.append({**row, "time": round(time.time(), 3),
                                  "tokens_per_s": round(row["tokens"] / wall_s, 2) if wall_s > 0 else 0.0})

    def propagation_s(self, version: int) -> float | None:
        """Seconds from publishing `version` until every live worker announced it holds it."""
        published = self.published_at.get(version)
        holders = self.intake.holders.get(version, {})
        workers = [e.peer_id for e in self.node.peertable.with_role("worker")]
        if published is None or not workers or any(w not in holders for w in workers):
            return None
        return round(max(holders[w] for w in workers) - published, 4)

    def _on_event(self, origin: str, event: Any) -> None:
        if origin == "intake" and isinstance(event, (BatchInvalidated, WorkerBanned)):
            self.intake_state.urgent()  # must survive a restart: saved now, not at the next interval
        if origin == "intake" and isinstance(event, BatchesSkewed):
            side = "behind" if event.median_age_s > 0 else "ahead of"
            log.warning("trainer: batches from %d worker(s) reached us ~%.0f s %s our clock (over %.0f s): they "
                        "are trained only if drawn and accepted (dropped[\"skewed\"]); many workers agreeing point "
                        "at this machine's clock (check NTP)", event.workers, abs(event.median_age_s), side,
                        self.intake.config.unchecked_max_skew_s)
        if origin == "intake" and isinstance(event, Penalise):
            for effect in self.node.peertable.penalise(trio.current_time(), event.peer, 2.0):
                self.node.carry_out(PEER_TABLE_CORE, effect)

    def status(self) -> dict[str, Any]:
        steps = [dict(h, propagation_s=self.propagation_s(h["step"]), **self.publish_timing.get(h["version"], {}))
                 for h in self.history]
        return {"version": self.version, "steps_target": self.config.steps, "done": self.done, "ranks": self.config.ranks,
                "history": steps, "workers": self.intake.workers_json(), "dropped": dict(self.intake.dropped),
                "recalled_batches": self.intake.recalled,
                "intake_state": self.intake_state.status(),
                **self.contributions_json()}

    def contributions_json(self) -> dict[str, Any]:
        """The leaderboard, the admitted-verdict log and each version's spread (the dashboard's)."""
        relayed = getattr(self.relay, "bytes_fetched_from", {})
        published = self.published_at
        spread = {str(v): {"published_s": round(published[v] - self.started_at, 3),
                           "holders": {p: round(t - published[v], 3) for p, t in self.intake.holders.get(v, {}).items()}}
                  for v in sorted(published)[-50:]}
        names = {entry.peer_id: entry.name for entry in self.node.peertable.peers() if entry.name}
        return {"leaderboard": self.intake.contributions.rows(names=names, relayed=relayed),
                "verdict_log": list(self.intake.contributions.verdict_log)[-1000:], "spread": spread,
                "started_at": self.started_at}


def _to_batch(batch: Any) -> Any:
    """A learner RolloutBatch from an admitted Submission (the worker is the envelope's sender)."""
    from trainer.rollout import Rollout, RolloutBatch

    sub = batch.submission
    rollouts = tuple(Rollout(row=r.row, prompt_ids=r.prompt, output_ids=r.output, logprobs=r.logprob_values,
                             stop_reason=r.stop_reason, proofs=r.proofs) for r in sub.rollouts)
    return RolloutBatch(worker_id=batch.worker, step=sub.step, model_version=sub.model_version, seed=sub.task_seed,
                        group_size=sub.group_size, temperature=sub.temperature, max_new_tokens=sub.max_new_tokens,
                        rollouts=rollouts)

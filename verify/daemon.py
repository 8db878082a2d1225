"""The validator role: the trio shell that runs `ValidatorCore` and recomputes rollouts in a thread.

`ValidatorRole(node, section)` is what `p2pnet peer start --role validator` builds (see
p2pnet/roles.py). It runs the core in its own nursery (`Node.run_core`: the core stops with
the role), carries out the core's `CheckRequested` events one at a time in a worker thread
(`trio.to_thread.run_sync`, one torch thread), feeds the results back with `check_done`,
charges `Penalise` events to the peer table, and registers the control command
`validator.status`.

Where models come from: `ModelSource(version)` returns a loaded model for a policy version:
`<checkpoint_dir>/v{version}` when that folder exists (the trainer's checkpoint layout),
else `model_path` (a single model folder serving every version: fixed-policy networks and
tests). It keeps the last `model_cache` models (LRU). `RelayModelSource(version)` instead
takes the weights of checkpoint `version` from the relay store; a version that does not load
(a chunk rotten on disk, files safetensors refuses, tensors that do not fit) is rejected:
logged once, listed in `rejected_versions`, its checks dropped without a verdict, the models
already loaded kept, and it is tried again only once its files change (the relay fetched them
again). Model folders, loading, weight swapping and the forward pass are `models` (the home the
worker role uses too: `models.folder`, `models.weights`, `models.forward`).

`SubmissionChecker` is the default checker: it recomputes the sampling seed and the
assigned prompts (`tasks.prompts`, the rules the trainer and workers use) and runs
`verify.check.check_rollout` on the rows the ticket chose, then the submission-level test
(verify.policy.RecentRollouts) with the calibration table of (the submission's declared stack,
this validator's stack), from verify/calibration_tables.json unless `calibration_file` names
another. TOPLOC is measured with the tie rule those tables were measured with (their `ties`:
"exact", or "open", the shipped ones; verify.toploc.measure) when a pair of them judges the
submission; with the paper's thresholds alone (no table fits the model or the pair) it is
measured with torch's choice, which those thresholds assume. Anything it cannot do for our
own reasons (no model for that version) raises `ModelUnavailable`: the core drops the check
without a verdict.

Must not: decide anything the core decides; import anything from `trainer`; import torch or
transformers before the first check (a plain peer never loads them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import trio

from p2pnet.config import from_mapping, validated
from p2pnet.control import Reply
from p2pnet.errors import ConfigError
from p2pnet.peertable import PEER_TABLE_CORE
from relay.loader import LOAD_FAILURES, RejectedVersions
from verify.errors import ProofError
from verify.calibration import CalibrationTables, load_tables
from verify.policy import SAME_STACK, RecentRollouts, Thresholds
from verify.reputation import BatchInvalidated, WorkerBanned
from verify.validator import (CheckDropped, CheckRequested, DroppedBecause, Penalise, ValidatorCore,
                              ValidatorCoreConfig, VerdictPublished)
from verify.messages import MAX_REASONS
from verify.verdicts import summarize

log = logging.getLogger(__name__)

CORE_NAME = "validator"
RECENT_EVENTS = 50


THRESHOLD_PRESETS = {"paper": Thresholds(), "same_stack": SAME_STACK}


class ModelUnavailable(RuntimeError):
    """We have no model for the submission's policy version (our side, not the worker's)."""


@validated
@dataclass(frozen=True)
class ValidatorConfig:
    model_path: Path | None = None
    checkpoint_dir: Path | None = None
    model_cache: int = 2
    device: str = "cpu"
    sample_rate: float = 1.0
    claim_window_s: float = 0.5
    takeover_after_s: float = 120.0
    max_queue: int = 16
    rollouts_per_check: int = 0
    task_seed: int | None = None
    max_new_tokens: int = 1024
    check_prompts: bool = True
    one_submission_per_step: bool = True
    workers: tuple[str, ...] = ()
    validators: tuple[str, ...] = ()
    ban_after_failures: int = 2
    ban_min_validators: int = 1
    ban_s: float = 0.0
    penalty: float = 2.0
    thresholds: dict[str, float] = field(default_factory=dict)
    version_wait_s: float = 60.0
    threshold_preset: str = "paper"  # "paper" (cross-hardware) or "same_stack" (only where measured bit-exact)
    aggregate_alpha: float = 1e-4  # false-rejection rate of the submission-level test; 0 turns it off
    aggregate_window: int = 256  # a worker's recent checked rollouts pooled per stack pair
    uncalibrated_stacks: str = "per_chunk_only"  # or "loosest": test undeclared/unmeasured stacks against the loosest pair
    calibration_file: Path | None = None  # default: the shipped verify/calibration_tables.json

    def own_stack_key(self) -> str:
        """This validator's stack before a model is loaded: model folders hold fp32 weights."""
        return f"fp32/torch/{self.device.split(':')[0]}"
    tasks: str = "arithmetic"  # task families the network draws prompts from (the trainer's `tasks`)

    def check(self) -> dict[str, str]:
        problems = {}
        if self.model_cache < 1:
            problems["model_cache"] = "must be >= 1"
        if self.device != "cpu" and not self.device.startswith("cuda"):
            problems["device"] = "must be 'cpu' or 'cuda[:N]'"
        if not self.penalty >= 0:
            problems["penalty"] = "must be >= 0"
        if not isinstance(self.tasks, str) or not self.tasks.strip():
            problems["tasks"] = "must name task families, e.g. 'arithmetic' or 'arithmetic,word_problems'"
        if self.threshold_preset not in THRESHOLD_PRESETS:
            problems["threshold_preset"] = f"must be one of {sorted(THRESHOLD_PRESETS)}"
        if not 0.0 <= self.aggregate_alpha < 1.0:
            problems["aggregate_alpha"] = "must lie in [0, 1) (0 turns the submission-level test off)"
        if self.aggregate_window < 1:
            problems["aggregate_window"] = "must be >= 1"
        if self.uncalibrated_stacks not in ("per_chunk_only", "loosest"):
            problems["uncalibrated_stacks"] = "must be 'per_chunk_only' or 'loosest'"
        try:
            tables = load_tables(self.calibration_file)
        except ValueError as exc:
            problems["calibration_file"] = str(exc)
        else:
            if self.threshold_preset == "same_stack" and \
                    self.own_stack_key() not in tables.validators_with_bit_exact_pair():
                exact = ", ".join(f"{w} -> {v}" for w, v in tables.bit_exact_pairs()) or "none"
                problems["threshold_preset"] = (
                    f"same_stack is allowed only for a validator stack measured bit-exact against some worker "
                    f"stack (docs/calibration.md; bit-exact pairs: {exact}); this validator is "
                    f"{self.own_stack_key()}: use threshold_preset = \"paper\"")
        if not isinstance(self.thresholds, dict):
            problems["thresholds"] = "must be a table of threshold overrides"
        else:
            known = {"exp_mismatches_max", "mant_err_mean_max", "mant_err_median_max",
                     "sign_mismatches_max", "max_failing_chunks"}
            unknown = sorted(set(self.thresholds) - known)
            if unknown:
                problems["thresholds"] = f"unknown threshold(s) {unknown}; known: {sorted(known)}"
        try:
            self.core_config()
        except ConfigError as exc:
            problems[exc.field] = exc.problem.rsplit(" (got ", 1)[0]
        return problems

    def core_config(self) -> ValidatorCoreConfig:
        names = {f.name for f in fields(ValidatorCoreConfig)}
        return ValidatorCoreConfig(**{n: getattr(self, n) for n in names if hasattr(self, n)})


# -- models and the checker -----------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedModel:
    forward: Callable[[list[int]], tuple[Any, Any]]
    tokenizer: Any
    eos_token_id: int
    vocab_size: int
    source: str
    module: Any = None  # the torch model behind `forward`, so a newer version can reuse it


class ModelSource:
    """`source(version) -> LoadedModel`, with an LRU of `cache_size` models (thread-safe)."""

    def __init__(self, model_path: Path | None, checkpoint_dir: Path | None, *, cache_size: int = 2,
                 device: str = "cpu", loader: Callable[[Path, str], LoadedModel] | None = None) -> None:
        self.model_path = model_path
        self.checkpoint_dir = checkpoint_dir
        self.cache_size = cache_size
        self.device = device
        self._loader = loader or load_model_folder
        self._cache: OrderedDict[Path, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()

    def folder_for(self, version: int) -> Path:
        if self.checkpoint_dir is not None:
            candidate = self.checkpoint_dir / f"v{version}"
            if candidate.is_dir():
                return candidate
        if self.model_path is not None:
            return self.model_path
        raise ModelUnavailable(f"no model folder for version {version}")

    def __call__(self, version: int) -> LoadedModel:
        folder = self.folder_for(version)
        with self._lock:
            model = self._cache.get(folder)
            if model is not None:
                self._cache.move_to_end(folder)
                return model
            try:
                model = self._loader(folder, self.device)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ModelUnavailable(f"cannot load {folder}: {exc}") from exc
            self._cache[folder] = model
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return model

    def cached(self) -> list[str]:
        return [str(p) for p in self._cache]


class RelayModelSource:
    """`source(version) -> LoadedModel`: a base model folder's architecture with the weights of
    checkpoint `version` from the relay store (verified chunk by chunk), with a small LRU."""

    def __init__(self, base_dir: Path, store: Any, *, cache_size: int = 2, device: str = "cpu") -> None:
        self.base_dir = base_dir
        self.store = store
        self.cache_size = cache_size
        self.device = device
        self._cache: OrderedDict[int, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self.rejected = RejectedVersions()

    def __call__(self, version: int) -> LoadedModel:
        with self._lock:
            model = self._cache.get(version)
            if model is not None:
                self._cache.move_to_end(version)
                return model
            try:
                stamp = self.store.version_stamp(version)
            except LOAD_FAILURES as exc:
                raise ModelUnavailable(f"version {version}: {exc}") from exc
            rejection = self.rejected.blocked(version, stamp)
            if rejection is not None:
                raise ModelUnavailable(f"version {version} was rejected: {rejection.reason}")
            # at capacity, the least recently used model is evicted anyway: swap the new weights
            # into it instead of building the architecture again (only once they loaded and fit)
            reuse = next(iter(self._cache.items())) if len(self._cache) >= self.cache_size else None
            try:
                model = load_model_folder(self.base_dir, self.device, weights=(self.store, version),
                                          reuse=reuse[1] if reuse is not None else None)
            except LOAD_FAILURES as exc:
                self.rejected.reject(version, stamp, str(exc), time.time())
                log.warning("validator: checkpoint version %d does not load (%s); its checks are dropped "
                            "until its files change", version, exc)
                raise ModelUnavailable(f"version {version} does not load: {exc}") from exc
            except (OSError, RuntimeError, ValueError) as exc:
                raise ModelUnavailable(f"cannot load version {version}: {exc}") from exc
            if reuse is not None:
                del self._cache[reuse[0]]
            self.rejected.loaded(version)
            self._cache[version] = model
            return model

    def cached(self) -> list[str]:
        return [f"v{v}" for v in self._cache]

    def rejected_versions(self) -> list[dict[str, Any]]:
        with self._lock:
            return self.rejected.to_json()


def load_model_folder(folder: Path, device: str, weights: tuple[Any, int] | None = None,
                      reuse: LoadedModel | None = None) -> LoadedModel:
    """Load a model folder and wrap its one-prefill forward (torch imported here).

    With `weights=(store, version)`, the folder gives the architecture and tokenizer and the
    relay store gives that checkpoint version's weights (`models.weights.load_version`); with
    `reuse`, an evicted model of the same folder takes those weights instead of a new model being
    built. The weights are read and checked against the model first: a version that does not load
    (`LOAD_FAILURES`) leaves `reuse` untouched."""
    import torch

    torch.set_num_threads(1)
    from models.folder import load_model_dir
    from models.forward import hidden_and_logits
    from models.weights import load_version

    if weights is not None:
        loaded = (reuse.module, reuse.tokenizer) if reuse is not None and reuse.module is not None else None
        model, tokenizer = load_version(folder, *weights, loaded=loaded)
    else:
        model, tokenizer = load_model_dir(folder)
    model.to(device)

    def forward(input_ids: list[int]) -> tuple[Any, Any]:
        return hidden_and_logits(model, input_ids)

    return LoadedModel(forward, tokenizer, int(tokenizer.eos_id), int(model.config.vocab_size), str(folder),
                       module=model)


@dataclass(frozen=True)
class TaskRules:
    """How a worker's sampling seed and prompts are derived (`tasks.prompts`, injected)."""

    sampling_seed: Callable[[int, str, int], int]
    prompt_ids: Callable[[str, int, int, int, Any], list[list[int]]]  # worker, step, task_seed, n, tokenizer


def task_rules(spec: str = "arithmetic") -> TaskRules:
    """The network's rules for task families `spec` (the trainer's and the workers' `tasks`)."""
    from tasks.prompts import TaskConfig, assign_prompts, prompt_ids_for, sampling_seed

    config = TaskConfig.from_spec(spec)

    def prompt_ids(worker: str, step: int, task_seed: int, n: int, tokenizer: Any) -> list[list[int]]:
        return prompt_ids_for(assign_prompts(worker, step, task_seed, n, config), tokenizer)

    return TaskRules(sampling_seed=lambda seed, worker, step: sampling_seed(seed, worker, step), prompt_ids=prompt_ids)


@dataclass(frozen=True)
class Judgement:
    """A checked submission (`SubmissionChecker.judge`): the verdict; per row checked, (row,
    accepted, reasons), none when it was refused whole for its seed; `explained`, the numbers
    behind each rejected row that was recomputed (`verify.check.explain`); `evidence`, the
    submission-level test's when it refused the batch."""

    accepted: bool
    reasons: tuple[str, ...]
    rows: tuple[tuple[int, bool, tuple[str, ...]], ...] = ()
    explained: Mapping[int, str] = field(default_factory=dict)
    evidence: str = ""


class SubmissionChecker:
    """`checker(request) -> (accepted, reasons)`: recompute the chosen rows of a submission."""

    def __init__(self, models: Callable[[int], LoadedModel], *, thresholds: dict[str, float] | None = None,
                 rules: TaskRules | Callable[[], TaskRules | None] | None = None, check_prompts: bool = True,
                 preset: str = "paper", tables: CalibrationTables | None = None, aggregate_alpha: float = 0.0,
                 aggregate_window: int = 256, device: str = "cpu", uncalibrated_stacks: str = "per_chunk_only") -> None:
        self.models = models
        self.threshold_overrides: dict[str, Any] = dict(thresholds or {})
        self.preset = THRESHOLD_PRESETS[preset]
        self._rules = rules  # a TaskRules, or a factory resolved on the first check (imports torch)
        self.check_prompts = check_prompts
        self.tables = tables
        # measure as the tables were measured (their "ties"); without tables, torch's choice
        self.exact_ties = tables.exact_ties if tables is not None else True
        self.aggregate_alpha = aggregate_alpha
        self.recent = RecentRollouts(aggregate_window)
        self.device_type = device.split(":")[0]
        self.aggregate_counts = {"tested": 0, "rejected": 0, "uncalibrated": 0}
        self._unfit_warned: set[str] = set()
        self.uncalibrated_stacks = uncalibrated_stacks

    def _own_stack_key(self, model: LoadedModel) -> str:
        module = model.module
        if module is None or not hasattr(module, "parameters"):
            return f"fp32/torch/{self.device_type}"
        from verify.messages import stack_of

        return stack_of(module, "torch").key

    def _pair(self, worker_stack: str, model: LoadedModel) -> Any:
        """The calibration of (declared worker stack, our stack), if the tables fit our model."""
        if self.tables is None:
            return None
        config = getattr(model.module, "config", None)
        if config is None or not self.tables.applies_to(config):
            if model.source not in self._unfit_warned:
                self._unfit_warned.add(model.source)
                log.warning("validator: the calibration tables were measured on another model than %s; the "
                            "submission-level test and same_stack do not apply to it (scripts/calibrate.py "
                            "measures a table for it)", model.source)
            return None
        own = self._own_stack_key(model)
        pair = self.tables.get(worker_stack, own)
        if pair is None and self.uncalibrated_stacks == "loosest":
            pair = self.tables.loosest_for(own)  # a worker cannot dodge the test by declaring nothing
        return pair

    def _thresholds(self, pair: Any) -> Thresholds:
        """same_stack applies only to pairs the table measured bit-exact; others get the paper's."""
        preset = self.preset
        if preset is SAME_STACK and (pair is None or not pair.bit_exact):
            preset = THRESHOLD_PRESETS["paper"]
        return replace(preset, **self.threshold_overrides)

    @property
    def rules(self) -> TaskRules | None:
        if callable(self._rules) and not isinstance(self._rules, TaskRules):
            self._rules = self._rules()
        return self._rules

    @classmethod
    def from_config(cls, config: ValidatorConfig, models: Callable[[int], LoadedModel]) -> "SubmissionChecker":
        """The checker a validator built from `config` runs (`ValidatorRole`, scripts/honest_checks.py)."""
        return cls(models, thresholds=config.thresholds, rules=lambda: task_rules(config.tasks),
                   check_prompts=config.check_prompts, preset=config.threshold_preset,
                   tables=load_tables(config.calibration_file), aggregate_alpha=config.aggregate_alpha,
                   aggregate_window=config.aggregate_window, device=config.device,
                   uncalibrated_stacks=config.uncalibrated_stacks)

    def __call__(self, request: CheckRequested) -> tuple[bool, tuple[str, ...]]:
        judgement = self.judge(request)
        return judgement.accepted, judgement.reasons

    def judge(self, request: CheckRequested) -> Judgement:
        """The verdict on a submission, the rows behind it and the numbers behind each rejection
        (also logged)."""
        from verify.check import check_rollout, explain

        sub = request.submission
        model = self.models(sub.model_version)
        if self.rules is not None:
            if sub.seed != self.rules.sampling_seed(sub.task_seed, request.worker, sub.step):
                return Judgement(False, ("wrong_seed",))
        expected_prompts = None
        if self.rules is not None and self.check_prompts:
            expected_prompts = self.rules.prompt_ids(request.worker, sub.step, sub.task_seed,
                                                     sub.prompts_per_submission, model.tokenizer)
        pair = self._pair(sub.stack.key, model)
        thresholds = self._thresholds(pair)
        # open ties only where the tables that were measured with them judge the statistics: the
        # paper's thresholds (no table fits this model or this pair) assume torch's choice
        exact_ties = self.exact_ties or pair is None
        results: list[tuple[int, bool, Sequence[str]]] = []
        explained: dict[int, str] = {}
        checked_chunks: list[Sequence[Any]] = []
        for row in request.rows:
            record = sub.rollouts[row]
            prompt, output = record.prompt, record.output
            if expected_prompts is not None and list(prompt) != list(expected_prompts[row // sub.group_size]):
                results.append((row, False, ("wrong_prompt",)))
                continue
            if (record.stop_reason == "eos") != (output[-1] == model.eos_token_id):
                results.append((row, False, ("bad_stop_reason",)))
                continue
            try:
                verdict = check_rollout(model.forward, prompt, output, record.proofs, seed=sub.seed, row=row,
                                        temperature=sub.temperature, eos_token_id=model.eos_token_id,
                                        max_new_tokens=sub.max_new_tokens, thresholds=thresholds,
                                        vocab_size=model.vocab_size, exact_ties=exact_ties)
            except ProofError:
                results.append((row, False, ("malformed_proof",)))
                continue
            if not verdict.accepted:
                explained[row] = explain(verdict)
                log.info("worker %s step %d version %d row %d rejected: %s", request.worker, sub.step,
                         sub.model_version, row, explained[row])
            results.append((row, verdict.accepted, verdict.reasons))
            checked_chunks.append(verdict.chunk_stats)
        accepted, reasons = summarize(results)
        evidence = ""
        if self.aggregate_alpha > 0.0 and checked_chunks:
            if pair is None:
                self.aggregate_counts["uncalibrated"] += 1
            else:
                self.aggregate_counts["tested"] += 1
                decision = self.recent.decide(request.worker, checked_chunks, pair, self.aggregate_alpha)
                if not decision.accepted:
                    self.aggregate_counts["rejected"] += 1
                    evidence = (", ".join(f"{name} {nats:.3g}" for name, nats in decision.evidence)
                                + f" (limit {decision.limit_nats:.3g} nats; {decision.rollouts} rollouts, "
                                f"{decision.recent_rollouts} recent)")
                    log.info("worker %s step %d version %d rejected by the submission-level test: %s",
                             request.worker, sub.step, sub.model_version, evidence)
                    accepted, reasons = False, (tuple(reasons) + decision.reasons)[:MAX_REASONS]
        return Judgement(accepted, tuple(reasons), tuple((row, ok, tuple(codes)) for row, ok, codes in results),
                         explained, evidence)


# -- the role ---------------------------------------------------------------------------------------


class ValidatorRole:
    def __init__(self, node: Any, section: dict[str, Any], *,
                 checker: Callable[[CheckRequested], tuple[bool, Sequence[str]]] | None = None,
                 model_source: Callable[[int], LoadedModel] | None = None) -> None:
        self.node = node
        self.config = from_mapping(ValidatorConfig, section, "validator")
        if checker is None and model_source is None and self.config.model_path is None \
                and self.config.checkpoint_dir is None:
            raise ConfigError("validator.model_path", "set model_path or checkpoint_dir (where models are found)")
        self.relay = node.roles.get("relay")
        if model_source is None and self.relay is not None and self.config.checkpoint_dir is None \
                and self.config.model_path is not None:
            model_source = RelayModelSource(self.config.model_path, self.relay.store,
                                            cache_size=self.config.model_cache, device=self.config.device)
        for folder in (self.config.model_path, self.config.checkpoint_dir):
            if folder is not None and not folder.is_dir():
                log.warning("validator: %s is not a folder (yet); checks will fail until it appears", folder)
        self.models = model_source or ModelSource(self.config.model_path, self.config.checkpoint_dir,
                                                  cache_size=self.config.model_cache, device=self.config.device)
        self.checker = checker or SubmissionChecker.from_config(self.config, self.models)
        trainers = tuple(self.relay.config.trusted_publishers) if self.relay is not None else ()  # recall askers
        self.core = ValidatorCore(replace(self.config.core_config(), trainers=trainers), node.identity,
                                  node.peertable)
        self.runner: Any = None
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        self._jobs_send, self._jobs_receive = trio.open_memory_channel[CheckRequested](self.config.max_queue + 8)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.node.on_event(self._on_event)
        async with trio.open_nursery() as nursery:  # the core runs as long as the role
            self.runner = await nursery.start(self.node.run_core, self.core, CORE_NAME)
            self.node.control.register("validator.status", self._status_command)
            task_status.started()
            async for request in self._jobs_receive:
                await self._check(request)

    async def _check(self, request: CheckRequested) -> None:
        sid = request.submission_id
        started = time.perf_counter()
        if isinstance(self.models, RelayModelSource) and self._may_come(request.submission.model_version):
            version = request.submission.model_version
            with trio.move_on_after(self.config.version_wait_s):
                while not self.relay.watcher.is_complete(version):
                    await self.relay.watcher.wait_newer(version - 1, at_least=version)
        try:
            accepted, reasons = await trio.to_thread.run_sync(self.checker, request)
        except ModelUnavailable as exc:
            log.warning("cannot check %s: %s", sid.hex()[:16], exc)
            await self.runner.command(lambda now: self.core.check_failed(now, sid, DroppedBecause.MODEL_UNAVAILABLE))
            return
        elapsed_s = time.perf_counter() - started
        await self.runner.command(
            lambda now: self.core.check_done(now, sid, accepted, tuple(reasons), len(request.rows), elapsed_s))

    def _may_come(self, version: int) -> bool:
        """Whether a submission's version is worth waiting for: its manifest reached our relay, or it
        is at most the one after our newest. A far-future version held the one check loop
        `version_wait_s` per submission (one worker, a fresh step each time, stalled every check)."""
        return self.relay.core.knows(version) or version <= self.relay.watcher.latest + 1

    def _on_event(self, origin: str, event: Any) -> None:
        if origin != CORE_NAME:
            return
        if isinstance(event, CheckRequested):
            self._jobs_send.send_nowait(event)  # the core bounds checks in flight below the channel size
        elif isinstance(event, Penalise):
            now = trio.current_time()
            for effect in self.node.peertable.penalise(now, event.peer, self.config.penalty):
                self.node.carry_out(PEER_TABLE_CORE, effect)
            self._remember("penalise", peer=event.peer, reason=event.reason)
        elif isinstance(event, VerdictPublished):
            v = event.verdict
            log.info("verdict %s on %s from %s: %s", "accept" if v.accepted else "reject",
                     v.submission_id.hex()[:16], v.worker, ",".join(v.reasons) or "-")
            self._remember("verdict", submission_id=v.submission_id.hex(), worker=v.worker, step=v.step,
                           accepted=v.accepted, reasons=list(v.reasons), check_s=round(event.check_s, 4))
        elif isinstance(event, BatchInvalidated):
            self._remember("invalidated", worker=event.worker, submission_id=event.submission_id.hex(),
                           validator=event.validator, reasons=list(event.reasons))
        elif isinstance(event, WorkerBanned):
            log.warning("worker %s banned after %d failed batches", event.worker, event.failures)
            self._remember("banned", worker=event.worker, failures=event.failures,
                           validators=list(event.validators))
        elif isinstance(event, CheckDropped):
            self._remember("dropped", submission_id=event.submission_id.hex(), reason=event.reason)

    def _remember(self, kind: str, **fields_: Any) -> None:
        self.recent.append({"event": kind, "at": round(trio.current_time(), 3), **fields_})

    async def _status_command(self, request: dict[str, Any], reply: Reply) -> dict[str, Any]:
        return {"peer_id": self.node.peer_id, "validator": self.status()}

    def status(self) -> dict[str, Any]:
        stats = self.core.status(trio.current_time())
        cached = self.models.cached() if isinstance(self.models, (ModelSource, RelayModelSource)) else []
        rejected = self.models.rejected_versions() if isinstance(self.models, RelayModelSource) else []
        aggregate = dict(getattr(self.checker, "aggregate_counts", {}))
        return {**stats, "sample_rate": self.config.sample_rate, "models_cached": cached,
                "rejected_versions": rejected, "submission_test": aggregate, "recent": list(self.recent)}


"""A vLLM rollout generator with replayable Gumbel-max sampling and TOPLOC proofs, and backend selection.

Owns: `select_generator` (which generator a worker uses: the torch one in trainer.rollout or
this one), `VllmGenerator` (same contract as `trainer.rollout.generate_batch`: returns
`(RolloutBatch, RolloutTiming)`), and the pieces that make vLLM's tokens replayable by a
validator with `verify.sampling`: a batch-level logits processor that, for each of our requests,
picks token = argmax(logits / T + gumbel_noise(seed, row, position, V)) and forces vLLM's greedy
sampler to take it, and a capture of the LM-head input (the hidden state that produced each
token, bf16) for the TOPLOC proofs.
Must not: import vllm at module import (this module is imported on CPU-only machines), open
sockets, sign, or compute rewards.

How one call works
------------------
1. The engine is built once, from the folder that already holds the version's verified files
   (the relay store keeps a version as the trainer's model folder: config, tokenizer, shards),
   or, for a model with no files (tests, tools), from a folder written from it. Every call
   names its policy version; a call with a version other than the engine's pushes that
   version's weights into the running engine (`load_weights`, the RLHF pattern), keyed by the
   version number and never by the model object (a worker swaps each version into the same
   object). The push streams tensor by tensor from the verified safetensors files, memory-
   mapped (`models.weights.stream_tensors`), inside the engine's worker: no CPU copy of the
   whole model is made, and only file names cross the RPC.
2. Each row is one request: its prompt ids (`{"prompt_token_ids": ...}`, no tokenizer in the
   engine), `SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True,
   stop_token_ids=[eos], detokenize=False, extra_args={"p2pnet": {call, row, seed, T}})`.
   temperature 0 makes vLLM sample greedily; the stop rule is exactly the torch path's (EOS or
   the length limit; generation_config EOS ids are not added because ignore_eos is set).
3. Inside the engine, per step: a forward pre-hook on the model's `logits_processor` module
   (the vLLM layer that receives `(lm_head, hidden_states)` where hidden_states are the final-norm
   outputs already pruned to the sampled positions, one row per request in persistent-batch
   order) stashes the hidden states; then the sampler calls our `ProofLogitsProcessor.apply`
   on the float32 logits of the same rows. For each of our requests it draws the noise for
   position = len(output ids so far), chooses the token, records (token, log softmax(logits/T)
   at the token, hidden row) under (call, row, position), and replaces the row by a one-hot
   (0 at the token, -inf elsewhere) so the greedy argmax takes exactly that token. A position
   recorded twice (a chunked-prefill partial step, a preempted and recomputed request) keeps
   the last write, which is the one whose token was kept.
4. After `generate`, the driver takes the records through the worker extension, checks them
   against vLLM's reported token ids (any disagreement raises), and builds proofs from the
   recorded hidden states with `trainer.rollout.build_row_proofs` (proof i covers the hidden
   state at prompt_len-1+i, the convention of `verify.check.generated_hidden_slice`).

vLLM APIs relied on (found in vLLM's docs and source; versions as found)
----------------------------------------------------------------------
- Custom batch-level logits processors of the V1 engine: subclass
  `vllm.v1.sample.logits_processor.LogitsProcessor` with `__init__(vllm_config, device,
  is_pin_memory)`, `is_argmax_invariant()`, `update_state(BatchUpdate | None)` and
  `apply(logits)`; loaded with `LLM(..., logits_processors=[FQCN or class])`; per-request
  arguments through `SamplingParams(extra_args=...)` (vLLM docs features/custom_logitsprocs,
  the offline example exists from v0.10.1.1; `validate_params` appears in later versions).
  vllm/v1/sample/logits_processor/interface.py (API docs v0.20.2, v0.29.0): BatchUpdate
  operations are processed in the order removed, added, moved, and each `added` entry carries
  a live reference to the request's output-token list. V1 has no per-request
  `SamplingParams.logits_processors` callables any more.
- The V1 sampler applies non-argmax-invariant logits processors before greedy sampling
  (the vllm/v1/sample/sampler.py class docstring, steps 5 and 7a, in the 0.10/0.11 line).
- From about vLLM 0.28 the GPU "model runner V2" is the default and has a different
  custom-logits-processor interface (docs v0.32.0 custom_logitsprocs); this module sets
  `VLLM_USE_V2_MODEL_RUNNER=0` to keep the V1 runner and its interface.
- The V1 GPU model runner computes `logits = model.compute_logits(hidden_states[logits_indices])`
  outside the CUDA graph, and Llama-family models compute it as
  `self.logits_processor(self.lm_head, hidden_states)` (vllm/v1/worker/gpu_model_runner.py,
  vllm/model_executor/models/llama.py); toploc's vLLM integration proves these same inputs.
- `LLM(worker_extension_cls="pkg.mod.Class")` mixes methods into the worker, called with
  `llm.collective_rpc("method", args=...)`; inside, `self.model_runner.model` is the model and
  `model.load_weights(weights=[(hf_name, tensor), ...])` loads HF-named weights (vLLM's RLHF
  examples). `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core in this process, so no
  tensor crosses a process boundary.
- `EngineArgs` fields used when the installed version has them: dtype, enforce_eager,
  skip_tokenizer_init, enable_prefix_caching, generation_config, async_scheduling (turned off:
  with async scheduling the output-token list can lag the step), gpu_memory_utilization,
  max_model_len, seed.

Status: written and unit-tested on a CPU-only machine without vLLM; NOT run on a GPU or
against a real vLLM in this task. The pure parts (noise choice, batch bookkeeping, capture
records, assembly, the whole step loop against an emulated engine over a transformers model)
are tested in tests/trainer/test_vllm_backend.py. A GPU check (scripts/gpu_check_vllm.py)
must verify: the engine starts with these arguments on the installed vLLM; `apply` sees as many
logits rows as the hook stashed hidden rows (else the records carry errors); every vLLM token
equals the recorded choice; `verify.check.check_rollout` against a transformers recomputation
accepts every rollout (sampling replay max deficit well under the 1.0 margin, TOPLOC exponent
and mantissa statistics within thresholds); EOS-terminated rows pass termination; the same with
`enforce_eager=False` (CUDA graphs) and after a weight push; and how much time the CPU noise
costs per step.
Limits: tensor_parallel_size 1 only; no speculative decoding (vLLM rejects custom logits
processors with it); the Gumbel noise is drawn on the CPU (numpy Philox) per row and step.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from p2pnet.errors import ConfigError
from trainer.rollout import (STOP_EOS, STOP_LENGTH, GenerationConfig, Rollout, RolloutBatch,
                             RolloutTiming, _RowOut, build_row_proofs, prompt_ids_for, sampling_seed)
from verify.sampling import gumbel_noise

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "vllm")
EXTRA_KEY = "p2pnet"  # SamplingParams.extra_args key that marks our requests
PROCESSOR_FQCN = f"{__name__}:ProofLogitsProcessor"
WORKER_EXTENSION = f"{__name__}.ProofWorkerExtension"


class VllmUnavailable(RuntimeError):
    """vLLM cannot run here (not installed, no CUDA, or a version without a needed API)."""


class GenerationMismatch(RuntimeError):
    """The engine's output disagrees with what our logits processor recorded (a bug, not a peer's fault)."""


# -- backend selection ----------------------------------------------------------------------


def vllm_status() -> tuple[bool, str]:
    """(usable, why not): vLLM is usable when `import vllm` works and CUDA is available."""
    if importlib.util.find_spec("vllm") is None:
        return False, "vllm is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # a broken install is reported, not hidden
        return False, f"import vllm failed: {type(exc).__name__}: {exc}"
    return True, ""


def select_generator(prefer: str = "auto") -> Callable[..., tuple[RolloutBatch, RolloutTiming]]:
    """The rollout generator for backend `prefer`: "torch", "vllm", or "auto" (vLLM when usable).

    Raises ConfigError naming `worker.backend` for an unknown value or for "vllm" where vLLM
    cannot run.
    """
    if prefer not in BACKENDS:
        raise ConfigError("worker.backend", f"must be one of {BACKENDS}, got {prefer!r}")
    if prefer == "torch":
        from trainer.rollout import generate_batch

        return generate_batch
    usable, why = vllm_status()
    if usable:
        return default_vllm_generator()
    if prefer == "vllm":
        raise ConfigError("worker.backend", f"'vllm' was requested but {why}; use 'torch' or 'auto'")
    from trainer.rollout import generate_batch

    return generate_batch


@functools.lru_cache(maxsize=1)
def default_vllm_generator() -> "VllmGenerator":
    """One engine per process, kept across steps (building one costs tens of seconds)."""
    return VllmGenerator()


# -- the noise choice (pure) ----------------------------------------------------------------


def choose_tokens(logits: torch.Tensor, keys: Sequence[tuple[int, int, int]],
                  temperatures: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row b: token = argmax(logits[b] / T_b + gumbel_noise(*keys[b], V)) and its log-prob.

    keys[b] = (seed, row, position). Returns (long [B], float32 [B]) on logits' device. The
    arithmetic is `verify.sampling.sample_tokens` and `token_logprobs` (float32 division and
    addition are correctly rounded on every device, so the argmax is the same).
    """
    if logits.dim() != 2 or logits.shape[0] != len(keys) or len(keys) != len(temperatures):
        raise ValueError(f"need logits [B, V] with B keys and temperatures, got {tuple(logits.shape)}")
    vocab = logits.shape[1]
    noise = torch.stack([gumbel_noise(s, r, p, vocab) for s, r, p in keys]).to(logits.device)
    temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float32,
                         device=logits.device)[:, None]
    scaled = logits.detach().float() / temps
    tokens = (scaled + noise).argmax(dim=-1)
    logps = torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, logps


def forced_rows(tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that make any argmax pick `tokens`: 0 at the token, -inf elsewhere."""
    rows = torch.full((tokens.shape[0], vocab), float("-inf"), dtype=dtype, device=tokens.device)
    rows.scatter_(1, tokens[:, None], 0.0)
    return rows


# -- what the engine records (lives in the engine's worker process) -------------------------


@dataclass(frozen=True)
class RowRecord:
    """A row's recorded choices in position order: hidden is bf16 [n, H] on the CPU."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    hidden: torch.Tensor


class CaptureStore:
    """Hidden states stashed by the hook and the choices recorded by the logits processor.

    Keyed by (call id, row) then position; a position written twice keeps the last write.
    Problems seen inside the engine are kept in `errors` (raising there would kill the engine)
    and raised by the driver after `take`.
    """

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None
        self.records: dict[tuple[str, int], dict[int, tuple[int, float, torch.Tensor | None]]] = {}
        self.errors: list[str] = []
        self.hook_handle: Any = None

    def pre_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: stash the hidden states a logits layer receives.

        vLLM's LogitsProcessor layer is called as (lm_head, hidden_states, ...), a plain lm_head
        Linear as (hidden_states,): the hidden states are the `hidden_states` keyword or the
        first tensor argument.
        """
        hidden = kwargs.get("hidden_states")
        if hidden is None:
            hidden = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if hidden is None:
            self.errors.append(f"hook on {type(module).__name__} saw no hidden-state tensor")
            return
        self.pending = hidden.detach()

    def consume(self, n_rows: int) -> torch.Tensor | None:
        hidden, self.pending = self.pending, None
        if hidden is None or hidden.dim() != 2 or hidden.shape[0] != n_rows:
            shape = None if hidden is None else tuple(hidden.shape)
            self.errors.append(f"captured hidden {shape} does not match {n_rows} logits rows")
            return None
        return hidden

    def record(self, call: str, row: int, position: int, token: int, logprob: float,
               hidden: torch.Tensor | None) -> None:
        self.records.setdefault((call, row), {})[position] = (token, logprob, hidden)

    def take(self, call: str) -> tuple[dict[int, RowRecord], list[str]]:
        """Remove and return this call's rows (and every error seen so far)."""
        rows: dict[int, RowRecord] = {}
        errors, self.errors = self.errors, []
        for key in [k for k in self.records if k[0] == call]:
            steps = self.records.pop(key)
            n = len(steps)
            if sorted(steps) != list(range(n)):
                errors.append(f"row {key[1]}: recorded positions {sorted(steps)} have gaps")
                continue
            if any(steps[p][2] is None for p in range(n)):
                errors.append(f"row {key[1]}: hidden state missing at some position")
                continue
            hidden = torch.stack([steps[p][2] for p in range(n)]).to("cpu", torch.bfloat16)
            rows[key[1]] = RowRecord(tokens=tuple(int(steps[p][0]) for p in range(n)),
                                     logprobs=tuple(float(steps[p][1]) for p in range(n)),
                                     hidden=hidden.contiguous())
        return rows, errors


STORE = CaptureStore()


def install_capture_hook(module: torch.nn.Module, store: CaptureStore | None = None) -> bool:
    """Hook `module` once (later calls are no-ops); returns True when a hook was added."""
    store = store or STORE
    if store.hook_handle is not None:
        return False
    store.hook_handle = module.register_forward_pre_hook(store.pre_hook, with_kwargs=True)
    return True


# -- the logits processor (runs inside the engine) ------------------------------------------


@dataclass(frozen=True)
class _Tracked:
    call: str
    row: int
    seed: int
    temperature: float
    output_ids: Sequence[int]  # live reference to the request's output tokens


def _is_swap(direction: Any) -> bool:
    return getattr(direction, "name", str(direction)).upper().endswith("SWAP")


class ProofSamplingCore:
    """The logic of `ProofLogitsProcessor`, free of vLLM so it can be tested on plain tensors.

    Tracks which persistent-batch index holds which of our requests (from BatchUpdate's
    removed / added / moved, in that order) and, in `apply`, chooses and records tokens.
    Requests without our extra_args are left untouched.
    """

    def __init__(self, store: CaptureStore | None = None) -> None:
        self.store = store or STORE
        self.tracked: dict[int, _Tracked] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: vLLM must apply it before greedy sampling

    def update_state(self, batch_update: Any) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.tracked.pop(index, None)
        for added in batch_update.added:
            index, params, output_ids = added[0], added[1], added[-1]
            extra = (getattr(params, "extra_args", None) or {}).get(EXTRA_KEY)
            if extra is None:
                self.tracked.pop(index, None)
                continue
            self.tracked[index] = _Tracked(call=str(extra["call"]), row=int(extra["row"]),
                                           seed=int(extra["seed"]),
                                           temperature=float(extra["temperature"]),
                                           output_ids=output_ids)
        for a, b, direction in batch_update.moved:
            a_val, b_val = self.tracked.pop(a, None), self.tracked.pop(b, None)
            if a_val is not None:
                self.tracked[b] = a_val
            if b_val is not None and _is_swap(direction):
                self.tracked[a] = b_val

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.tracked:
            self.store.pending = None
            return logits
        hidden = self.store.consume(logits.shape[0])
        index = sorted(i for i in self.tracked if i < logits.shape[0])
        if not index:
            return logits
        states = [self.tracked[i] for i in index]
        keys = [(s.seed, s.row, len(s.output_ids)) for s in states]
        tokens, logps = choose_tokens(logits[index], keys, [s.temperature for s in states])
        logits[index] = forced_rows(tokens, logits.shape[1], logits.dtype)
        tok_list, lp_list = tokens.tolist(), logps.tolist()
        for j, (i, s) in enumerate(zip(index, states)):
            h = None if hidden is None else hidden[i].to(torch.bfloat16)
            self.store.record(s.call, s.row, keys[j][2], tok_list[j], lp_list[j], h)
        return logits


def _build_processor_class() -> type:
    if importlib.util.find_spec("vllm") is None:
        raise VllmUnavailable("vllm is not installed")
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessor
    except ImportError as exc:
        raise VllmUnavailable(f"this vllm has no V1 custom logits processors: {exc}") from exc

    class ProofLogitsProcessor(ProofSamplingCore, LogitsProcessor):
        """vLLM V1 logits processor: seeded Gumbel-max choice plus proof capture."""

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            ProofSamplingCore.__init__(self)

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            extra = (getattr(sampling_params, "extra_args", None) or {}).get(EXTRA_KEY)
            if extra is not None and not {"call", "row", "seed", "temperature"} <= set(extra):
                raise ValueError(f"extra_args[{EXTRA_KEY!r}] needs call, row, seed and temperature")

    ProofLogitsProcessor.__module__ = __name__
    ProofLogitsProcessor.__qualname__ = "ProofLogitsProcessor"
    return ProofLogitsProcessor


def __getattr__(name: str) -> Any:
    """`ProofLogitsProcessor` is built on first access, so importing this module needs no vLLM."""
    if name == "ProofLogitsProcessor":
        cls = _build_processor_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ProofWorkerExtension:
    """Methods mixed into vLLM's worker (`worker_extension_cls`), called by collective_rpc."""

    def p2pnet_install_capture(self) -> str:
        model = self.model_runner.model  # type: ignore[attr-defined]
        target = getattr(model, "logits_processor", None)
        if not isinstance(target, torch.nn.Module):
            raise VllmUnavailable(f"{type(model).__name__} has no logits_processor layer to hook")
        install_capture_hook(target)
        return type(model).__name__

    def p2pnet_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        return len(weights)

    def p2pnet_load_weight_files(self, paths: list[str]) -> int:
        """Stream the tensors of verified safetensors files into the engine's weight loader."""
        from models.weights import stream_tensors

        count = 0

        def counted():
            nonlocal count
            for item in stream_tensors(paths):
                count += 1
                yield item

        self.model_runner.model.load_weights(weights=counted())  # type: ignore[attr-defined]
        return count

    def p2pnet_take(self, call: str) -> tuple[dict[int, RowRecord], list[str]]:
        return STORE.take(call)


# -- the generator (driver side) ------------------------------------------------------------


@dataclass(frozen=True)
class RowRequest:
    row: int
    prompt_ids: tuple[int, ...]


class Engine(Protocol):
    """What VllmGenerator needs from an engine; tests substitute an emulation.

    `ensure` makes the engine hold policy `version` (the weights of `weight_files`, or of
    `model` when there are no files) and returns what that cost, in seconds by name."""

    def ensure(self, model: Any, tokenizer: Any, *, version: int,
               weight_files: Sequence[Any] = ()) -> dict[str, float]: ...

    def run(self, call: str, requests: Sequence[RowRequest], *, seed: int, eos_id: int,
            config: GenerationConfig) -> dict[int, list[int]]: ...

    def take(self, call: str) -> tuple[dict[int, RowRecord], list[str]]: ...


@dataclass(frozen=True)
class VllmConfig:
    dtype: str = "bfloat16"  # the validator compares bf16 hidden states
    enforce_eager: bool = True  # no CUDA graphs until a GPU check shows the hook fires with them
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 0  # 0: the model's own limit
    work_dir: str = ""  # where the engine's model folder is written; "" = a temporary folder

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError("dtype must be bfloat16, float16 or float32")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be >= 0")


def request_extra(call: str, row: int, seed: int, temperature: float) -> dict[str, Any]:
    return {EXTRA_KEY: {"call": call, "row": row, "seed": seed, "temperature": temperature}}


class VllmEngine:
    """A vLLM `LLM` with our logits processor, worker extension and capture hook."""

    def __init__(self, config: VllmConfig = VllmConfig()) -> None:
        self.config = config
        self.llm: Any = None
        self.version: int | None = None  # the policy version the engine holds
        self.started_from: Path | None = None  # the existing model folder it was started from
        self.pushes: list[int] = []  # versions pushed into the running engine, in order
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def ensure(self, model: Any, tokenizer: Any, *, version: int,
               weight_files: Sequence[Any] = ()) -> dict[str, float]:
        if self.llm is not None and self.version == version:
            return {}
        t0 = time.perf_counter()
        if self.llm is None:  # from the version's own folder, or from `model`: it holds `version`
            self._start(model, tokenizer, _model_folder_of(weight_files))
            key = "engine_start_s"
        else:
            self._push(model, [str(f) for f in weight_files if str(f).endswith(".safetensors")])
            self.pushes.append(version)
            key = "weights_push_s"
        self.version = version
        return {key: time.perf_counter() - t0}

    def _push(self, model: Any, files: list[str]) -> None:
        """New weights into the running engine: streamed from `files`, else copied off `model`."""
        if files:
            self.llm.collective_rpc("p2pnet_load_weight_files", args=(files,))
            return
        from models.weights import snapshot_state

        self.llm.collective_rpc("p2pnet_load_weights", args=(list(snapshot_state(model).items()),))

    def _start(self, model: Any, tokenizer: Any, folder: Path | None = None) -> None:
        """Start the engine from `folder` (a complete model folder that exists: no copy), or from
        a temporary folder written from `model`."""
        usable, why = vllm_status()
        if not usable:
            raise VllmUnavailable(why)
        # The V1 runner (our processor's interface) in this process (records stay local).
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, EngineArgs

        self.started_from = folder
        if folder is None:
            from models.folder import save_model_dir

            root = self.config.work_dir
            if not root:
                self._tmp = tempfile.TemporaryDirectory(prefix="p2pnet-vllm-")
                root = self._tmp.name
            folder = save_model_dir(model, tokenizer, Path(root) / f"model-{uuid.uuid4().hex[:8]}")
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        for needed in ("logits_processors", "worker_extension_cls"):
            if needed not in known:
                raise VllmUnavailable(f"this vllm's EngineArgs has no {needed!r} (need a V1 vLLM, 0.10.1+)")
        wanted = dict(dtype=self.config.dtype, enforce_eager=self.config.enforce_eager,
                      skip_tokenizer_init=True, enable_prefix_caching=False, generation_config="vllm",
                      async_scheduling=False, gpu_memory_utilization=self.config.gpu_memory_utilization,
                      seed=0, tensor_parallel_size=1, logits_processors=[PROCESSOR_FQCN],
                      worker_extension_cls=WORKER_EXTENSION)
        if self.config.max_model_len:
            wanted["max_model_len"] = self.config.max_model_len
        skipped = sorted(k for k in wanted if k not in known)
        if skipped:
            log.warning("vllm EngineArgs lacks %s; starting without them", skipped)
        self.llm = LLM(model=str(folder), **{k: v for k, v in wanted.items() if k in known})
        names = self.llm.collective_rpc("p2pnet_install_capture")
        log.info("vllm engine up for %s (capture hook on %s)", folder, names)

    def run(self, call: str, requests: Sequence[RowRequest], *, seed: int, eos_id: int,
            config: GenerationConfig) -> dict[int, list[int]]:
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=config.max_new_tokens, ignore_eos=True,
                                 stop_token_ids=[eos_id], detokenize=False,
                                 extra_args=request_extra(call, r.row, seed, config.temperature))
                  for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return {r.row: list(o.outputs[0].token_ids) for r, o in zip(requests, outputs)}

    def take(self, call: str) -> tuple[dict[int, RowRecord], list[str]]:
        return self.llm.collective_rpc("p2pnet_take", args=(call,))[0]


def _model_folder_of(weight_files: Sequence[Any]) -> Path | None:
    """The folder holding a version's files when it is a complete model folder (config and every
    weight file of its index), else None."""
    if not weight_files:
        return None
    from models.folder import ModelFolderError, weight_files as folder_weights

    folder = Path(weight_files[0]).parent
    if not (folder / "config.json").is_file():
        return None
    try:
        folder_weights(folder)
    except ModelFolderError:
        return None
    return folder


def assemble_rows(reported: Mapping[int, Sequence[int]], records: Mapping[int, RowRecord],
                  errors: Sequence[str], *, eos_id: int, max_new_tokens: int) -> dict[int, _RowOut]:
    """Rows as trainer.rollout builds them, after checking the engine against our records.

    vLLM's token ids must be the recorded choices (it may leave out a final stop token); a row
    ends with EOS or at exactly max_new_tokens. Anything else raises GenerationMismatch.
    """
    if errors:
        raise GenerationMismatch("engine-side capture problems: " + "; ".join(errors[:5]))
    out: dict[int, _RowOut] = {}
    for row, ids in reported.items():
        rec = records.get(row)
        if rec is None or not rec.tokens:
            raise GenerationMismatch(f"row {row}: nothing recorded by the logits processor")
        toks, n = list(rec.tokens), len(rec.tokens)
        ids = [int(t) for t in ids]
        if not (ids == toks or (ids == toks[:-1] and toks[-1] == eos_id)):
            raise GenerationMismatch(f"row {row}: engine tokens {ids[:8]} differ from recorded {toks[:8]}")
        if eos_id in toks[:-1] or (toks[-1] != eos_id and n != max_new_tokens) or n > max_new_tokens:
            raise GenerationMismatch(f"row {row}: {n} tokens do not end at EOS or the limit")
        out[row] = _RowOut(output_ids=toks, logprobs=list(rec.logprobs), hidden=rec.hidden,
                           stop_reason=STOP_EOS if toks[-1] == eos_id else STOP_LENGTH)
    return out


class VllmGenerator:
    """Callable with `trainer.rollout.generate_batch`'s signature, backed by an Engine."""

    def __init__(self, config: VllmConfig = VllmConfig(), engine: Engine | None = None) -> None:
        self.engine = engine if engine is not None else VllmEngine(config)

    def __call__(self, model: Any, tokenizer: Any, tasks: Sequence[Any], *, worker_id: str, step: int,
                 model_version: int, seed: int, config: GenerationConfig = GenerationConfig(),
                 weight_files: Sequence[Any] = ()) -> tuple[RolloutBatch, RolloutTiming]:
        """`weight_files`: the verified files of `model_version` (pushed into the engine from
        disk); without them the engine takes the weights of `model`."""
        timing = RolloutTiming()
        timing.extra.update(self.engine.ensure(model, tokenizer, version=model_version,
                                               weight_files=weight_files))
        prompts = prompt_ids_for(tasks, tokenizer)
        g = config.group_size
        requests = [RowRequest(row=r, prompt_ids=tuple(prompts[r // g])) for r in range(len(prompts) * g)]
        call = uuid.uuid4().hex
        t0 = time.perf_counter()
        reported = self.engine.run(call, requests, seed=sampling_seed(seed, worker_id, step),
                                   eos_id=tokenizer.eos_id, config=config)
        records, errors = self.engine.take(call)
        timing.generate_s = time.perf_counter() - t0
        outs = assemble_rows(reported, records, errors, eos_id=tokenizer.eos_id,
                             max_new_tokens=config.max_new_tokens)
        proofs = build_row_proofs(outs, config, timing)
        rollouts = tuple(Rollout(row=q.row, prompt_ids=q.prompt_ids, output_ids=tuple(outs[q.row].output_ids),
                                 logprobs=tuple(outs[q.row].logprobs), stop_reason=outs[q.row].stop_reason,
                                 proofs=proofs.get(q.row, ()))
                         for q in requests)
        timing.n_tokens = sum(len(r.output_ids) for r in rollouts)
        batch = RolloutBatch(worker_id=worker_id, step=step, model_version=model_version, seed=seed,
                             group_size=g, temperature=config.temperature,
                             max_new_tokens=config.max_new_tokens, rollouts=rollouts)
        return batch, timing

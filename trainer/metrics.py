"""The worker's and the trainer's Prometheus metrics (providers for `p2pnet.metrics.PeerCollector`).

Worker: batches, rollouts and tokens generated, seconds spent generating and building proofs
(running totals the role keeps), the last batch's tokens per second and proof time, the policy
version in use. Trainer: the step (policy version), last loss, reward and accuracy, batches
accepted and rejected by validators and trained on (from the intake's ledger), tokens trained
on, the last step's time by phase (gather, train, checkpoint write, publish) and running totals
of each, how long the last version took to reach every worker. Read at scrape time from the
roles' own state; nothing here changes a role.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from p2pnet.metrics import counter, gauge

STEP_PHASES = (("gather", "gather_s"), ("train", "train_s"), ("checkpoint_write", "write_s"),
               ("publish", "publish_s"))


class WorkerMetrics:
    def __init__(self, node: Any) -> None:
        self.node = node

    def collect(self, role: Any) -> Iterator[Metric]:
        totals = role.totals
        yield counter("p2pnet_worker_batches_submitted", "Rollout batches signed and gossiped.", totals["batches"])
        yield counter("p2pnet_worker_rollouts", "Rollouts (sequences) generated.", totals["rollouts"])
        yield counter("p2pnet_worker_tokens_generated", "Output tokens generated.", totals["tokens"])
        yield counter("p2pnet_worker_generate_seconds", "Seconds spent generating.", totals["generate_s"])
        yield counter("p2pnet_worker_proof_seconds", "Seconds spent building TOPLOC proofs.", totals["proof_s"])
        last = role.submitted[-1] if role.submitted else None
        rate = last["tokens"] / last["generate_s"] if last and last["generate_s"] > 0 else None
        yield gauge("p2pnet_worker_tokens_per_second", "Output tokens per second of generation, last batch.", rate)
        yield gauge("p2pnet_worker_proof_build_seconds", "Seconds to build the last batch's proofs.",
                    last["proof_s"] if last else None)
        yield gauge("p2pnet_worker_policy_version", "Checkpoint version generated with (-1: none yet).",
                    role.version)


class TrainerMetrics:
    def __init__(self, node: Any) -> None:
        self.node = node

    def collect(self, role: Any) -> Iterator[Metric]:
        history = role.history
        last = history[-1] if history else None
        yield gauge("p2pnet_trainer_step", "Policy version the trainer has reached.", role.version)
        yield gauge("p2pnet_trainer_steps_target", "Steps the trainer trains for.", role.config.steps)
        yield counter("p2pnet_trainer_steps", "Training steps taken (trained or skipped).", len(history))
        for name, key, doc in (("loss", "loss", "GRPO loss of the last step."),
                               ("reward_mean", "reward_mean", "Mean reward of the last step's batches."),
                               ("accuracy", "accuracy", "Share of correct answers in the last step's batches.")):
            yield gauge(f"p2pnet_trainer_{name}", doc, last[key] if last else None)
        ledgers = role.intake.workers.values()
        batches = CounterMetricFamily("p2pnet_trainer_batches", "Worker batches by what became of them: accepted or "
                                      "rejected by validators' signed verdicts (one accepted, then rejected by a later "
                                      "verdict, counts under both), trained on.", labels=["outcome"])
        batches.add_metric(["accepted"], sum(l.accepted_ever for l in ledgers))
        batches.add_metric(["rejected"], sum(l.rejected for l in ledgers))
        batches.add_metric(["trained"], sum(l.trained_batches for l in ledgers))
        yield batches
        yield gauge("p2pnet_trainer_workers_banned", "Workers whose batches the intake refuses.",
                    sum(1 for l in ledgers if l.banned))
        yield counter("p2pnet_trainer_tokens_trained", "Output tokens of the batches trained on.",
                      sum(h.get("tokens", 0) for h in history))
        timing = role.publish_timing
        last_step = GaugeMetricFamily("p2pnet_trainer_last_step_phase_seconds", "The last step's seconds by phase "
                                      "(checkpoint write and publish run beside the next step).", labels=["phase"])
        totals = CounterMetricFamily("p2pnet_trainer_step_phase_seconds", "Seconds spent in each phase, all steps.",
                                     labels=["phase"])
        rows = [{**h, **timing.get(h["version"], {})} for h in history]
        for phase, key in STEP_PHASES:
            values = [r[key] for r in rows if key in r]
            if values:
                last_step.add_metric([phase], values[-1])
            totals.add_metric([phase], sum(values))
        yield last_step
        yield totals
        published = [v for v in timing.values() if "publish_s" in v]
        yield gauge("p2pnet_trainer_checkpoint_publish_seconds", "Seconds to publish the last checkpoint "
                    "(manifest signed and announced).", published[-1]["publish_s"] if published else None)
        spread = role.propagation_s(last["step"]) if last else None
        yield gauge("p2pnet_trainer_version_propagation_seconds", "Seconds from publishing the last version until "
                    "every live worker held it.", spread)

"""A trainer killed mid-run (SIGKILL, no shutdown) and started again finishes the run: the
network does not stall. Real `p2pnet peer start` processes on loopback, laid out as the devnet
lays them out: the trainer, a validator and a worker. The trainer is killed as soon as its status
says version 1 (trained; written and published, or not yet): the worker's batch for step 1 then
reaches a dead trainer or one about to die, or, when the kill came before version 1's write, the
restarted trainer is at version 0 and needs step 0's batch again, which the worker will not send
by itself. The restarted trainer must get it back (its kept batches, `trainer.intake_kept`, or by
asking, `verify.recall`) and train every step. Every wait has a deadline that scales with the
steps."""

from __future__ import annotations

import time

from p2pnet.localnet import start_peer
from trainer.devnet import DevnetConfig, _plan, _prepare_model, _start_peers

STEPS = 2
STEP_DEADLINE_S = 180.0  # one step on a loaded 2-core machine, model loading included


def trainer_status(proc) -> dict:
    return proc.status(timeout_s=30)["role_status"]["trainer"]


def wait_for(proc, done, what: str, deadline_s: float) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        assert proc.alive(), f"the trainer exited; see {proc.log_path}"
        status = trainer_status(proc)
        if done(status):
            return status
        assert time.monotonic() < deadline, f"{what} not within {deadline_s:.0f} s: {status['version']=}; " \
                                            f"see {proc.log_path}"
        time.sleep(0.2)


def test_a_trainer_killed_mid_run_and_started_again_finishes_the_run(tmp_path):
    config = DevnetConfig(steps=STEPS, workers=1, byzantine=0, validators=1, relays=0, model="micro",
                          prompts_per_batch=4, group_size=2)
    model_dir, model_name = _prepare_model(config, tmp_path)
    plan, _ = _plan(config, tmp_path, model_dir, model_name)
    procs: dict = {}
    seen: dict = {}
    try:
        _start_peers(plan, procs, tmp_path, None, seen, ready_timeout_s=STEP_DEADLINE_S)
        trainer = procs["trainer"]
        wait_for(trainer, lambda s: s["version"] >= 1, "version 1", 2 * STEP_DEADLINE_S)
        trainer.proc.kill()  # SIGKILL: nothing saved on the way out
        trainer.proc.wait(timeout=30)
        name, roles, _ = plan[0]
        again = start_peer(name, trainer.data_dir, roles=roles, bootstrap=[procs["validator0"].addr],
                           extra_args=["--config", str(trainer.data_dir / "peer.toml")], log_dir=tmp_path,
                           into=procs)  # the same data folder, key and checkpoints
        again.wait_ready(STEP_DEADLINE_S)
        resumed = trainer_status(again)["version"]  # 1, or 0 when the kill came before version 1's write
        assert resumed in (0, 1)
        status = wait_for(again, lambda s: s["done"], f"steps {resumed}..{STEPS}",
                          (STEPS - resumed + 1) * STEP_DEADLINE_S)
        assert status["version"] == STEPS and all(row["trained"] for row in status["history"])
    finally:
        for proc in procs.values():
            proc.stop(timeout_s=15)

"""The trainer package: tasks and rewards, rollout generation, GRPO and the learner.

Owns everything that runs a model for training: the local tokenizer and tiny model,
seeded verifiable tasks, batched generation with replayable sampling and TOPLOC
proofs, the GRPO loss, and the learner that trains on admitted batches and writes
versioned checkpoints.

Must not open sockets or run an event loop: every public function here is plain
synchronous code that a trio shell can call through `trio.to_thread.run_sync`.
"""

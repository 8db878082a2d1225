"""Tasks: verifiable prompts and their rewards, one home for the trainer, workers and validators.

`tasks.base` (the Task type and answer checking), `tasks.arithmetic`, `tasks.word_problems`
(procedurally generated, no download), `tasks.prompts` (which tasks a worker gets for a step, the
ids a model sees, chat template included, the sampling seed, and the reward). Pure: no torch.
"""

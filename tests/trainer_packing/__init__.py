"""Sequence packing and token-budget micro-batches of the trainer (docs/packing.md): the packed and
micro-batched forwards against the plain padded one of ``RLPolicyModule``."""

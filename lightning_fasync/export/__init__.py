"""Checkpoint → Hugging Face model directory (``lightning-fasync export``): ``hf`` writes the
directory; a trainer backend with its own checkpoint layout registers its handler
(:mod:`lightning_fasync.registry`). See ``docs/export.md``.
"""

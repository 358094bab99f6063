"""lightning-fasync: fully-asynchronous RL training of LLM policies for PyTorch Lightning and Fabric.

Docstrings say "the spec" for the contract this package implements, written down in
``docs/contract.md`` (parameter names, capacity and window formulas, the step protocol, metric
names and their aggregation); "§N" cites its section N.

Layout (no import cycle between these packages; ``tests/test_layering.py`` checks it):
``errors`` and ``registry`` (leaves), ``config/`` (schema, load, validate), ``pipeline/`` (the
scheduler and the step protocol; no Lightning, HTTP or model imports), ``weights/`` (trainer →
engine transport), ``fleet/`` (what drives the engines), ``engine/`` (the embedded engine, its own
process), ``runtime/`` (what both drivers share: the composition root, the followers' table),
``lightning/`` (Lightning and Fabric drivers), ``trainers/`` (FSDP2, Megatron), ``export/``,
``algorithms/``, ``data/``, ``agents/``. ``registry`` names what varies: windows, engine backends,
weight-sync paths, trainer backends.
"""

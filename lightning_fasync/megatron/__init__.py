"""megatron-core as the trainer's model: Hugging Face <-> megatron-core conversion, model building,
and the parallel layout's validation (docs/megatron.md).

``convert`` and ``parallel`` need only torch; ``model`` imports megatron-core (the ``megatron``
extra: ``pip install -e ".[megatron]"``).
"""

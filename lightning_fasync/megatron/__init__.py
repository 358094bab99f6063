"""megatron-core as the trainer's model: Hugging Face <-> megatron-core conversion, model building,
and the parallel layout's validation (docs/megatron.md).

``convert`` and ``parallel`` need only torch; ``model``, ``shards``, ``checkpoint`` and the
Lightning pieces, :class:`MegatronStrategy` and :class:`MegatronPolicyModule`, import megatron-core
(the ``megatron`` extra: ``pip install -e ".[megatron]"``).
"""

__all__ = ["MegatronPolicyModule", "MegatronStrategy"]


def __getattr__(name: str):
    # Lazily: these import Lightning (and, when used, megatron-core); ``convert`` and ``parallel`` do not.
    if name == "MegatronStrategy":
        from lightning_fasync.megatron.strategy import MegatronStrategy

        return MegatronStrategy
    if name == "MegatronPolicyModule":
        from lightning_fasync.megatron.module import MegatronPolicyModule

        return MegatronPolicyModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

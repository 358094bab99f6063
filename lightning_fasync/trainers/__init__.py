"""Trainer backends beyond Lightning's own strategies, one package each: ``fsdp`` (FSDP2 and tensor
parallel over Lightning's ``ModelParallelStrategy``) and ``megatron`` (megatron-core). Each is one
:class:`~lightning_fasync.registry.TrainerBackend` record in :data:`lightning_fasync.registry.TRAINERS`.
"""

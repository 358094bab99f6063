"""Trainer → engine weight transport: :class:`~lightning_fasync.weights.tensor_stream.TensorStream`
(the trainer's weights, one tensor at a time), the registered sync paths (``sync`` for ``tensor``
and ``disk``, ``group`` for ``distributed``), the wire format (``wire``), checksums
(``checksum``) and the gather of sharded parameters (``shard_gather``). See
``docs/weight_sync.md``. Import the submodules you need.
"""

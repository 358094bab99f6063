"""A weight-sync path of your own: one module plus a registration (docs/extending.md).

``checked-tensor`` is the ``tensor`` path followed by a check: after each push every engine reports
the checksums of the weights it now holds (SGLang's ``/weights_checker``, action ``checksum``) and
they are compared with the checksums of what was sent. A mismatch fails the sync naming the
tensor, as any failed sync does (``WeightSyncError``).

Use it by listing this module in ``fully_async.plugins`` (imported before the config is checked)
and naming the path::

    PYTHONPATH=examples lightning-fasync fit --config configs/tiny_cpu.yaml \\
        --fully_async.plugins='[weight_path_plugin]' --rollout.weight_sync=checked-tensor
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from lightning_fasync.registry import WEIGHT_PATHS, WeightPath
from lightning_fasync.weights.checksum import checksums, compare
from lightning_fasync.weights.sync import KeptWeights, TensorWeightSync, WeightSyncError, unique_tensors
from lightning_fasync.weights.tensor_stream import TensorStream


class CheckedTensorSync(TensorWeightSync):
    """The ``tensor`` path, then every engine's checksums against what was sent.

    A sharded trainer's :class:`TensorStream` is gathered whole first (it is hashed as well as
    sent), so this path suits policies that fit in the trainer's memory.
    """

    async def push(self, named_tensors: Any, version: Optional[int], step: Optional[int] = None) -> Optional[KeptWeights]:
        if isinstance(named_tensors, TensorStream):
            named_tensors = dict(named_tensors)
        expected = checksums(unique_tensors(named_tensors))
        kept = await super().push(named_tensors, version, step)
        reported = await self.client.weight_checksums()
        for i, sums in enumerate(reported):
            diffs = compare(expected, sums)
            if diffs:
                raise WeightSyncError(
                    f"Engine {i} holds other weights than were sent at weight version {version}: {diffs[0]}"
                    + (f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""))
        print(f"checked-tensor: weight version {version} verified on {len(reported)} engine(s)",
              file=sys.stderr, flush=True)
        return kept


WEIGHT_PATHS.register("checked-tensor", WeightPath(
    name="checked-tensor", make=CheckedTensorSync, client_method="update_weights_from_tensor"))

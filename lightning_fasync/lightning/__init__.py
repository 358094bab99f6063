"""Lightning and Fabric integration: the callback, the policy module, the strategy, the Fabric loop."""

from lightning_fasync.lightning.batch import RolloutBatch, rollout_dataloader
from lightning_fasync.lightning.callback import FullyAsyncCallback
from lightning_fasync.lightning.fabric_loop import FullyAsyncFabricLoop
from lightning_fasync.lightning.hooks import FullyAsyncHooks
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.lightning.strategy import FullyAsyncStrategy

__all__ = [
    "FullyAsyncCallback",
    "FullyAsyncFabricLoop",
    "FullyAsyncHooks",
    "FullyAsyncStrategy",
    "RLPolicyModule",
    "RolloutBatch",
    "rollout_dataloader",
]

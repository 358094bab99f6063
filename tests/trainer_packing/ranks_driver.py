"""Micro-batched, packed training calls on two CPU processes (gloo), against one process training
each whole call padded.

    python -m tests.trainer_packing.ranks_driver OUT_DIR fabric-ddp|fabric-fsdp2|lightning-ddp|lightning-fsdp2
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.trainer_packing.ranks_driver OUT_DIR NAME,NAME,...

Run alone, the launcher (Fabric's, or Lightning's DDP) re-runs this script for rank 1. Under
``torch.distributed.run`` (as test_ranks.py runs it) both ranks exist already, and Fabric and the
Trainer take them from its environment: the two processes run each named driver in turn, on one
process group. Each driver writes into ``OUT_DIR/NAME``. Each training call's
groups are shared by tokens (``dp_share(..., tokens=group_tokens)``), so the ranks get the same
number of groups but not of tokens; with a small token budget they need different numbers of
micro-batches, which they agree on. Both drivers' own optimisation runs (Fabric: ``backward``,
``clip_gradients``, ``step``; Lightning: automatic optimisation with ``gradient_clip_val``). After
the calls, rank 0 trains the same calls in this process alone (padded, one forward each, the whole
call) and every rank writes what it saw to ``OUT_DIR/NAME/rank{r}.json`` for test_ranks.py.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.runtime.ranks import dp_share, group_tokens
from tests.trainer_packing.calls import make_groups

CALLS = 4  # two rollout steps of two calls
CLIP = 0.05
BUDGET = 24
ALGORITHM = {"is_correction": {"enable": True}, "opsm": {"enable": True}}  # (M2PO's mask is per rank by design)


def calls() -> list[list]:
    """Each call's groups: 4 of 2, long-tailed (a 40-token response makes its group heavy)."""
    return [make_groups(20 + i, num_groups=4, n=2, lengths=(1, 2, 3, 40)) for i in range(CALLS)]


def at(i: int) -> dict:
    return {"rollout_step": i // 2, "call_index": i % 2, "calls_per_step": 2}


class SGDPolicy(RLPolicyModule):
    def _optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.policy.parameters(), lr=0.5)


def build(cls: type = SGDPolicy, **overrides) -> SGDPolicy:
    from lightning_fasync.config import load_config

    cfg = load_config({"algorithm": ALGORITHM})
    return cls("tiny", **{**RLPolicyModule.algorithm_args(cfg), **overrides})


def reference() -> dict[str, torch.Tensor]:
    """One process, whole calls, padded, one forward each: the update the ranks must reproduce."""
    module = build(pack_sequences=False)
    opt = module._optimizer()
    for i, groups in enumerate(calls()):
        if i % 2 == 0:
            module.begin_rollout_step(i // 2)
        loss = module.training_step(RolloutBatch(groups=groups, **at(i)), i)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.policy.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Recorder:
    """What a rank trained: its groups' prompts and tokens, its micro-batch counts."""

    def __init__(self) -> None:
        self.shares: list[list[str]] = []
        self.tokens: list[int] = []
        self.planned: list[int] = []
        self.ran: list[int] = []
        self.sharded = False  # whether the policy's parameters were DTensor shards

    def share(self, module, groups, rank: int, size: int, i: int) -> RolloutBatch:
        mine = dp_share(groups, rank, size, tokens=group_tokens)
        self.shares.append([str(g.sample.prompt_id) for g in mine])
        self.tokens.append(sum(group_tokens(g) for g in mine))
        data = module.prepare_rollout_batch(mine)
        self.planned.append(len(data.forwards.micro_batches))
        return RolloutBatch(groups=mine, data=data, **at(i))

    def dump(self, out: str, rank: int, params: dict, ref: dict | None) -> None:
        report = {"rank": rank, "shares": self.shares, "tokens": self.tokens, "planned": self.planned, "ran": self.ran,
                  "sharded": self.sharded}
        if ref is not None:
            report["max_param_gap"] = max((full(params[k]) - v).abs().max().item() for k, v in ref.items())
            report["moved"] = max((full(params[k]) - v).abs().max().item()
                                  for k, v in build(pack_sequences=False).policy.state_dict().items())
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump(report, fh)


def run_fabric(out: str, name: str) -> None:
    import lightning as L

    strategy: object = "ddp"
    if name == "fabric-fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy

        from lightning_fasync.trainers.fsdp.sharding import shard_policy

        def parallelize(module, device_mesh):
            shard_policy(module.policy, device_mesh)
            return module

        strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    module = build(pack_sequences=True, max_tokens_per_micro_batch=BUDGET)
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(module._optimizer())
    rec = Recorder()
    for i, groups in enumerate(calls()):  # what FullyAsyncFabricLoop._train_call does, every rank
        if i % 2 == 0:
            module.begin_rollout_step(i // 2)
        batch = rec.share(module, groups, rank, 2, i)
        loss = model.training_step(batch, i)
        rec.ran.append(len(batch.data.forwards.micro_batches))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    rec.sharded = any(hasattr(p, "device_mesh") for p in module.policy.parameters())
    params = {k: full(v).detach().clone() for k, v in module.policy.state_dict().items()}
    rec.dump(out, rank, params, reference() if rank == 0 else None)


def run_lightning(out: str, name: str) -> None:
    import lightning.pytorch as pl

    rec = Recorder()

    class Fed(SGDPolicy):
        """Fills Lightning's empty tickets with this rank's share of each call, as the callback does."""

        def train_dataloader(self):
            from lightning_fasync.lightning.batch import rollout_dataloader

            return rollout_dataloader()

        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx % 2 == 0:
                self.begin_rollout_step(batch_idx // 2)
            filled = rec.share(self, calls()[batch_idx], self.global_rank, self.trainer.world_size, batch_idx)
            batch.groups, batch.data = filled.groups, filled.data
            batch.rollout_step, batch.call_index, batch.calls_per_step = filled.rollout_step, filled.call_index, 2

        def on_train_batch_end(self, outputs, batch, batch_idx):
            rec.ran.append(len(batch.data.forwards.micro_batches))

    module = build(Fed, pack_sequences=True, max_tokens_per_micro_batch=BUDGET)
    strategy: object = "ddp"
    if name == "lightning-fsdp2":  # RLPolicyModule.configure_model shards the policy over the mesh
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(max_steps=CALLS, accelerator="cpu", devices=2, strategy=strategy, gradient_clip_val=CLIP,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(module)
    rank = trainer.global_rank
    rec.sharded = any(hasattr(p, "device_mesh") for p in module.policy.parameters())
    params = {k: full(v).detach().clone() for k, v in module.policy.state_dict().items()}
    rec.dump(out, rank, params, reference() if rank == 0 else None)


DRIVERS = ("fabric-ddp", "fabric-fsdp2", "lightning-ddp", "lightning-fsdp2")


def main() -> None:
    out, names = sys.argv[1], sys.argv[2].split(",")
    if unknown := [n for n in names if n not in DRIVERS]:
        sys.exit(f"ranks_driver: no driver {unknown}; they are {', '.join(DRIVERS)}")
    if len(names) > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        sys.exit("ranks_driver: several drivers run under python -m torch.distributed.run --nproc-per-node 2")
    torch.set_num_threads(1)
    for name in names:
        where = os.path.join(out, name)
        os.makedirs(where, exist_ok=True)
        torch.manual_seed(0)
        if name.startswith("lightning-"):
            run_lightning(where, name)
        else:
            run_fabric(where, name)


if __name__ == "__main__":
    main()

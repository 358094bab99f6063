"""Micro-batched training calls under the real drivers' optimisation: Lightning's automatic
optimisation (its zero_grad after ``training_step``, gradient clipping, the grad-norm metric) and
Fabric's ``backward`` / ``clip_gradients``, against the same calls in one padded forward."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric

from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.lightning.module import RLPolicyModule
from tests.trainer_packing.calls import make_groups

CALLS = 4  # two rollout steps of two calls: the second call of each runs under the step-start snapshot
CLIP = 0.05  # well below the calls' gradient norms, so every step clips
VARIANTS = {"packed": {"pack_sequences": True}, "packed-micro": {"pack_sequences": True, "max_tokens_per_micro_batch": 40},
            "padded-micro": {"pack_sequences": False, "max_tokens_per_micro_batch": 40}}


class SGDPolicy(RLPolicyModule):
    """Plain SGD, so the update is the gradient itself (AdamW's first step is its sign); the tickets
    of ``rollout_dataloader`` are filled with fixed calls (no rollout side)."""

    def _optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.policy.parameters(), lr=0.5)

    def on_train_batch_start(self, batch, batch_idx):
        # As FullyAsyncCallback does: the dataloader's empty ticket is filled when the call starts.
        filled = _batches()[batch_idx]
        batch.groups, batch.rollout_step = filled.groups, filled.rollout_step
        batch.call_index, batch.calls_per_step = filled.call_index, filled.calls_per_step
        if batch.call_index == 0:
            self.begin_rollout_step(batch.rollout_step)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(dict(self.rollout_metrics()))


def _batches() -> list[RolloutBatch]:
    return [RolloutBatch(groups=make_groups(10 + i), rollout_step=i // 2, call_index=i % 2, calls_per_step=2)
            for i in range(CALLS)]


def _lightning(**overrides) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    module = SGDPolicy("tiny", **overrides)
    module.seen = []
    trainer = pl.Trainer(max_steps=CALLS, accelerator="cpu", devices=1, gradient_clip_val=CLIP, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}, module.seen


def _fabric(**overrides) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    fabric = Fabric(accelerator="cpu", devices=1)
    module = SGDPolicy("tiny", **overrides)
    model, optimizer = fabric.setup(module, module._optimizer())
    seen = []
    for i, batch in enumerate(_batches()):  # what FullyAsyncFabricLoop._train_call does
        if batch.call_index == 0:
            module.begin_rollout_step(batch.rollout_step)
        loss = model.training_step(batch, i)
        fabric.backward(loss)
        fabric.call("on_before_optimizer_step", optimizer)  # the module measures train/grad_norm here
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen.append(dict(module.rollout_metrics()))
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}, seen


def _assert_same(got, want) -> None:
    (params, metrics), (ref_params, ref_metrics) = got, want
    for name, value in ref_params.items():
        gap = (params[name] - value).abs().max().item()
        assert gap <= 1e-6, (name, gap)
    assert len(metrics) == len(ref_metrics) == CALLS
    for m, ref in zip(metrics, ref_metrics):
        for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy", "train/approx_kl"):
            assert m[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
        assert ref["train/grad_norm"] > CLIP  # the clipping clipped


@pytest.mark.parametrize("driver", [_lightning, _fabric], ids=["lightning", "fabric"])
def test_micro_batched_updates_are_the_whole_calls_updates(driver):
    want = driver(pack_sequences=False)
    for name, overrides in VARIANTS.items():
        _assert_same(driver(**overrides), want)


def test_the_earlier_micro_batches_are_not_zeroed_by_lightning():
    """The other direction: a module that let Lightning's zero_grad run after its in-step backwards
    would train on the last micro-batch only, and its update would differ from the whole call's."""

    class LetLightningZero(SGDPolicy):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            self._accumulated = False
            optimizer.zero_grad()

    module = LetLightningZero("tiny", pack_sequences=True, max_tokens_per_micro_batch=40)
    module.seen = []
    pl.Trainer(max_steps=CALLS, accelerator="cpu", devices=1, gradient_clip_val=CLIP, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module)
    want, _ = _lightning(pack_sequences=False)
    gaps = [(module.policy.state_dict()[k] - v).abs().max().item() for k, v in want.items()]
    assert max(gaps) > 1e-4


def test_a_call_that_raised_mid_way_leaves_no_gradients_behind():
    """A micro-batched call that raised after zeroing (an out-of-memory backward, say) leaves its
    partial gradients and the skip of Lightning's zero_grad set: the next call must not train on them."""
    module = SGDPolicy("tiny", pack_sequences=False)
    module.seen = []
    for p in module.policy.parameters():
        p.grad = torch.full_like(p, 3.0)
    module._accumulated = True
    pl.Trainer(max_steps=CALLS, accelerator="cpu", devices=1, gradient_clip_val=CLIP, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module)
    _assert_same(({k: v.detach().clone() for k, v in module.policy.state_dict().items()}, module.seen),
                 _lightning(pack_sequences=False))

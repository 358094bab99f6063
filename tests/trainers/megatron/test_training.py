"""MegatronStrategy + MegatronPolicyModule against RLPolicyModule on one process.

Two training calls of one rollout step (the second under the old-actor snapshot) run through
Lightning's Trainer with ``MegatronStrategy`` on 2 CPU ranks (gloo; megatron-core's DDP, distributed
optimizer and ``get_forward_backward_func`` schedule, under ``tests/helpers/megatron_cpu.py``'s
``cpu_training_shim``), and through ``RLPolicyModule`` with torch's AdamW on one process, from the
same Hugging Face weights and batches. Tensor parallel (vocab-parallel log-probs) and pipeline
parallel (two micro-batches, p2p) must give the same metrics (loss, entropy, gradient norm, which
Adam's update would hide a wrong loss scale from) and the same weights after the steps, as the
engines receive them (the HF-named stream, gathered from the shards); data parallel (each rank one
of the call's two groups, the distributed optimizer's reduce-scatter) the same gradient norm and
weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.megatron_cpu import require_megatron, run_ranks

require_megatron()

from lightning_fasync.config import AlgorithmConfig  # noqa: E402
from lightning_fasync.lightning.batch import RolloutBatch  # noqa: E402
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus  # noqa: E402

pytestmark = pytest.mark.slow

LR = 1e-2
COMPARED = ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/clip_ratio")


def save_tiny_model(path, family: str = "qwen3", layers: int = 2) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_fasync.policy import build_char_tokenizer

    # qwen3: tied embeddings, q/k norms, 4 heads on 2 kv heads, vocab 96; qwen3_moe: top-2 of 4
    # experts on every layer, without the router's auxiliary loss (HF's RL loss has none).
    from transformers import AutoConfig

    from tests.helpers.megatron_cpu import _COMMON, TINY

    extra = {"router_aux_loss_coef": 0.0} if family == "qwen3_moe" else {}
    cfg = AutoConfig.for_model(family, **{**_COMMON, **TINY[family], "num_hidden_layers": layers, **extra})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)


def make_batches() -> list[RolloutBatch]:
    """Two calls of rollout step 0, 4 sequences each (2 groups of 2), of unequal lengths."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for call in range(2):
        groups = []
        for k in range(2):
            prompt = torch.randint(3, 96, (3 + k,), generator=g).tolist()
            trajs = []
            for i in range(2):
                n = 4 + 2 * i + k
                t = Trajectory(prompt_id=PromptId(0, 2 * call + k), sample_index=i, prompt_ids=prompt,
                               status=TrajectoryStatus.COMPLETED, reward=float((i + k + call) % 2))
                t.extend(torch.randint(3, 96, (n,), generator=g).tolist(),
                         (-torch.rand(n, generator=g) * 3).tolist(), [0] * n)
                trajs.append(t)
            groups.append(TrajectoryGroup(PromptSample(PromptId(0, 2 * call + k), prompt), 0, trajs))
        batches.append(RolloutBatch(groups=groups, rollout_step=0, call_index=call, calls_per_step=2))
    return batches


def module_kwargs() -> dict:
    # No clipping, no weight decay: the update is Adam's alone on both sides.
    return dict(lr=LR, betas=(0.9, 0.99), algorithm=AlgorithmConfig(entropy_coef=0.01), snapshot_offload=False)


def reference_run(model_dir) -> tuple[list[dict], dict]:
    from lightning_fasync.algorithms import grad_norm_metric
    from lightning_fasync.lightning.module import RLPolicyModule

    module = RLPolicyModule(str(model_dir), **module_kwargs())
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8)
    metrics = []
    module.begin_rollout_step(0)
    for batch in make_batches():
        optimizer.zero_grad()
        loss = module.training_step(batch, 0)
        loss.backward()
        m = dict(module.rollout_metrics())
        m.update(grad_norm_metric(module.policy.parameters()))
        optimizer.step()
        metrics.append(m)
    return metrics, {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def megatron_ranks(rank, jobs):
    """Every layout's run in the same two processes, one after the other (a process group and
    megatron-core's parallel state per run would cost a spawn each)."""
    for model_dir, out, sizes, micro_batch_size, extra in jobs:
        megatron_rank(rank, model_dir, out, sizes, micro_batch_size, extra=extra)


def megatron_rank(rank, model_dir, out, sizes, micro_batch_size, world=2, extra=None):
    import lightning.pytorch as pl

    from lightning_fasync.trainers.megatron import MegatronPolicyModule, MegatronStrategy

    class Record(pl.Callback):
        def __init__(self):
            self.metrics = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # What FullyAsyncCallback does: fill the dataloader's ticket with this data-parallel
            # rank's share of the call's groups.
            from lightning_fasync.runtime.ranks import data_parallel, dp_share

            vars(batch).update(vars(make_batches()[batch_idx]))
            dp_rank, dp_size, _ = data_parallel(trainer.strategy)
            batch.groups = dp_share(batch.groups, dp_rank, dp_size)
            pl_module.begin_rollout_step(0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.metrics.append(dict(pl_module.rollout_metrics()))

        def on_train_end(self, trainer, pl_module):  # parallel state is torn down after fit
            stream = pl_module.engine_state_dict()
            if rank == 0:
                torch.save({"metrics": self.metrics, "weights": dict(stream)}, out)
            else:
                stream.drain()

    module = MegatronPolicyModule(str(model_dir), micro_batch_size=micro_batch_size, grad_clip=0.0,
                                  **module_kwargs(), **(extra or {}))
    record = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=MegatronStrategy(**sizes), max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[record], use_distributed_sampler=False)
    trainer.fit(module)  # the module's rollout_dataloader() tickets


LAYOUTS = {  # id: (MegatronStrategy sizes, model.micro_batch_size, (family, layers)[, module arguments])
    "tp2": ({"tensor_model_parallel_size": 2}, None, ("qwen3", 2)),
    "pp2-2microbatches": ({"pipeline_model_parallel_size": 2}, 2, ("qwen3", 2)),
    "pp2-vpp2-interleaved": ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, 1,
                             ("qwen3", 4)),
    "dp2-distributed-optimizer": ({}, None, ("qwen3", 2)),
    "ep2-dp2-moe": ({"expert_model_parallel_size": 2}, None, ("qwen3_moe", 2)),
    "pp2-bf16": ({"pipeline_model_parallel_size": 2}, 2, ("qwen3", 2), {"mixed_precision": "bf16"}),
    # Expert TP = 2 is not here: the all-to-all dispatcher then all-gathers tokens of unequal counts
    # over the expert-TP group, which NCCL takes and gloo refuses.
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each layout's model directory and what its Megatron run left (metrics, pushed weights)."""
    root = tmp_path_factory.mktemp("megatron_training")
    jobs, dirs = [], {}
    for name, (sizes, micro_batch_size, model, *extra) in LAYOUTS.items():
        dirs[name] = root / name
        save_tiny_model(dirs[name] / "model", *model)
        jobs.append((dirs[name] / "model", dirs[name] / "megatron.pt", sizes, micro_batch_size, *(extra or [None])))
    run_ranks(megatron_ranks, 2, jobs, init_process_group=False, timeout=480)
    return dirs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_training_calls_equal_single_process_rlpolicymodule(runs, layout):
    sizes = LAYOUTS[layout][0]
    model_dir = runs[layout] / "model"
    got = torch.load(runs[layout] / "megatron.pt", weights_only=True)
    want_metrics, want_weights = reference_run(model_dir)

    assert len(got["metrics"]) == 2
    # With DP=2 rank 0 trained one of the two groups: its own metrics are of its share (the callback
    # reduces them over the ranks); the gradient norm is the whole call's.
    data_parallel = not sizes or "expert" in str(sizes)  # EP = 2 spans the two DP ranks
    compared = ("train/grad_norm",) if data_parallel else COMPARED
    bf16 = "bf16" in layout  # against the float32 reference: bf16's own rounding, and no more
    for call, (g, w) in enumerate(zip(got["metrics"], want_metrics)):
        for key in compared:
            rel, abs_ = (2e-2, 1e-3) if bf16 else (1e-4, 1e-6)
            assert math.isclose(g[key], w[key], rel_tol=rel, abs_tol=abs_), (call, key, g[key], w[key])
    assert got["metrics"][1]["train/lr"] == pytest.approx(LR)
    # The engines' view: HF names and shapes (the checkpoint's: per-expert, no lm_head when tied),
    # every tensor, the trained values.
    from transformers import AutoModelForCausalLM

    from lightning_fasync.trainers.megatron.convert.qwen3_moe import unfuse_experts

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    initial = unfuse_experts(dict(hf.state_dict()))
    want_weights = unfuse_experts(want_weights)
    tied = {"lm_head.weight"} if hf.config.tie_word_embeddings else set()
    assert set(got["weights"]) == set(want_weights) - tied
    if bf16:
        # The engines get bfloat16; nearly every element that both float32 steps moved one way by
        # more than the learning rate (its gradient's sign settled) moved that way here too.
        assert {t.dtype for t in got["weights"].values()} == {torch.bfloat16}
        agree = settled = 0
        for name, tensor in got["weights"].items():
            want, moved = want_weights[name] - initial[name], tensor.float() - initial[name]
            mask = want.abs() > 1.5 * LR
            settled += int(mask.sum())
            agree += int((torch.sign(want) == torch.sign(moved))[mask].sum())
        assert settled > 1000 and agree / settled > 0.97, (agree, settled)
        return
    for name, tensor in got["weights"].items():
        assert tensor.shape == want_weights[name].shape, name
        # Adam divides by the root of the squared gradient, so an element whose gradient is near
        # zero moves by up to lr on summation-order noise alone (other splits, other sums): nearly
        # every element must agree closely, and none by more than a tenth of the two steps' reach.
        diff = (tensor - want_weights[name]).abs()
        assert diff.max() < 0.1 * 2 * LR, (name, diff.max().item())
        off = int((diff > 1e-5).sum())
        assert off <= max(1, 0.02 * diff.numel()), (name, off, diff.numel())
    trained = [n for n, t in got["weights"].items() if not torch.equal(t, initial[n])]
    assert len(trained) == len(got["weights"]), sorted(set(got["weights"]) - set(trained))

"""Sharding the policy for ModelParallelStrategy on 2 CPU processes (gloo): tensor parallel and
FSDP2 give the single-process logits, loss, gradients and AdamW step; the module's
``configure_model`` hook, the old-actor snapshot and ``train/grad_norm`` work on the shards."""

from __future__ import annotations

import copy
import math
import os
import time
import types

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessRaisedException

from lightning_fasync.config import ConfigError
from lightning_fasync.trainers.fsdp.sharding import shard_policy, tp_head_layout
from lightning_fasync.fleet.launch import free_port

# ---------------------------------------------------------------------------------------- helpers


def _rank_entry(rank: int, world: int, port: int, fn, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, *args, world: int = 2, timeout: float = 240.0) -> None:
    """Run ``fn(rank, *args)`` in ``world`` fresh processes joined in a gloo group on 127.0.0.1.

    A child's exception fails the test with its traceback; a run past ``timeout`` seconds kills
    the children and fails naming the timeout.
    """
    ctx = mp.start_processes(_rank_entry, args=(world, free_port(), fn, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{fn.__name__} on {world} processes timed out after {timeout:.0f} s")
    except ProcessRaisedException as exc:
        pytest.fail(f"{fn.__name__} failed on a rank:\n{exc}", pytrace=False)
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _mesh(dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _qwen3() -> torch.nn.Module:
    """A tiny Qwen3 from a config: 2 kv heads (they split over TP=2), per-head q/k norms, q/k/v/o
    biases and tied embeddings."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                         tie_word_embeddings=True, initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return AutoModelForCausalLM.from_config(config).train()


def _tiny() -> torch.nn.Module:
    from lightning_fasync.policy import build_policy

    return build_policy("tiny")[0].train()


def _loss(model: torch.nn.Module, ids: torch.Tensor, count: int) -> torch.Tensor:
    """Summed next-token cross-entropy over ``count`` tokens of the global batch: split over DP
    ranks, the averaged gradient (x world size) is the gradient of the global mean."""
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum") / count


def _assert_grads_match(sharded: torch.nn.Module, ref: torch.nn.Module, what: str) -> None:
    for (name, p), (ref_name, q) in zip(sharded.named_parameters(), ref.named_parameters()):
        assert name == ref_name
        grad = _full(p.grad)
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{what} {name}: {m}")


def _assert_adamw_step_matches(sharded: torch.nn.Module, ref: torch.nn.Module) -> None:
    """One AdamW step on the shards gives the parameters the same step gives in one process (on the
    same gradients: AdamW's g / (|g| + eps) would magnify fp32 noise of gradients near zero)."""
    with torch.no_grad():
        for p, q in zip(sharded.parameters(), ref.parameters()):
            q.grad.copy_(_full(p.grad))
    for model in (sharded, ref):
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).step()
    for (name, p), q in zip(sharded.named_parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.detach()), q.detach(), rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def _check_against_single_process(build, mesh, dp_rank: int, dp: int, **shard_args) -> None:
    from lightning_fasync.algorithms import clip_grad_norm, grad_norm_metric

    model = build()
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    tied = getattr(model.config, "tie_word_embeddings", False)
    assert shard_policy(model, mesh, **shard_args) is model
    assert list(model.state_dict()) == keys  # Hugging Face names, for weight sync and checkpoints
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(4, 60, (4, 10), generator=torch.Generator().manual_seed(3))
    count = ids[:, 1:].numel()
    rows = ids.chunk(dp)[dp_rank]  # this DP rank's half (all of it without DP)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=rows).logits, ref(input_ids=rows).logits, rtol=1e-5, atol=1e-5)
    loss = _loss(model, rows, count) * dp  # FSDP averages over DP: x dp restores the sum
    ref_loss = _loss(ref, ids, count)
    loss.backward()
    ref_loss.backward()
    if dp == 1:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    _assert_grads_match(model, ref, type(model).__name__)
    norm = grad_norm_metric(ref.parameters())["train/grad_norm"]
    assert grad_norm_metric(model.parameters())["train/grad_norm"] == pytest.approx(norm, rel=1e-5)
    # Clipping by norm (torch's clip_grad_norm_ cannot mix TP's and FSDP's meshes).
    assert clip_grad_norm(model.parameters(), norm / 4).item() == pytest.approx(norm, rel=1e-5)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), norm / 4)
    _assert_grads_match(model, ref, f"clipped {type(model).__name__}")
    _assert_adamw_step_matches(model, ref)


# ---------------------------------------------------------------------------------------- TP = 2


def _tensor_parallel_checks(rank: int) -> None:
    mesh = _mesh(1, 2)
    # The embedded default: 4 heads on ONE kv head (each rank uses it whole, for its 2 heads).
    assert tp_head_layout(_tiny().config, 2) == "replicated_kv"
    _check_against_single_process(_tiny, mesh, 0, 1)
    # Qwen3 with 2 kv heads (one per rank), q/k norms shared over heads, tied embeddings, and
    # activation checkpointing (its recompute repeats the forward collectives).
    _check_against_single_process(_qwen3, mesh, 0, 1, activation_checkpointing=True)


@pytest.mark.slow
def test_tensor_parallel_matches_single_process():
    run_ranks(_tensor_parallel_checks)


# ---------------------------------------------------------------------------------------- FSDP DP = 2


def _snapshot_checks(rank: int, mesh) -> None:
    """OldActorSnapshot on FSDP2 + DTensor shards restores the step-start values exactly, also when
    FSDP keeps the gathered parameters after forward (reshard_after_forward=False)."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_fasync.algorithms import OldActorSnapshot

    model = shard_policy(_tiny(), mesh, reshard_after_forward=False)
    ids = torch.randint(4, 60, (2, 8), generator=torch.Generator().manual_seed(rank))
    snap = OldActorSnapshot(model, offload_to_cpu=True)

    def local() -> list[torch.Tensor]:  # this rank's shards (after a forward FSDP holds gathered copies)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return [p.to_local().clone() for p in model.parameters()]

    snap.begin_step(0)
    with torch.no_grad(), snap.use_old_weights() as swapped:
        assert not swapped
        start_logits = model(input_ids=ids).logits
    start = local()
    assert [tuple(b.shape) for b in snap._buffers] == [tuple(t.shape) for t in start]  # the shards, not the full
    model(input_ids=ids).logits.float().square().mean().backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    live = local()
    assert any(not torch.equal(a, b) for a, b in zip(start, live))
    with torch.no_grad():
        live_logits = model(input_ids=ids).logits  # leaves this rank's layers gathered
        with snap.use_old_weights() as swapped:
            assert swapped and all(torch.equal(a, b) for a, b in zip(local(), start))
            assert torch.equal(model(input_ids=ids).logits, start_logits)
        assert torch.equal(model(input_ids=ids).logits, live_logits)  # no stale gathered copy of the old weights
        assert all(torch.equal(a, b) for a, b in zip(local(), live))


def _module_checks(rank: int, mesh) -> None:
    """RLPolicyModule.configure_model shards once; two training calls of one rollout step (the
    second under the step-start snapshot) give the single-process losses, metrics, grad norm and
    clipped update."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_fasync.config import FasyncConfig
    from lightning_fasync.lightning.batch import RolloutBatch
    from lightning_fasync.lightning.module import RLPolicyModule
    from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus

    def group(seed: int) -> TrajectoryGroup:
        g = torch.Generator().manual_seed(seed)
        prompt = [1, 10, 11, 12]
        trajs = []
        for i in range(4):
            t = Trajectory(prompt_id=PromptId(0, seed), sample_index=i, prompt_ids=prompt,
                           status=TrajectoryStatus.COMPLETED, reward=float(i % 2))
            response = torch.randint(4, 90, (6,), generator=g).tolist()
            t.extend(response, (-torch.rand(6, generator=g) - 0.5).tolist(), [0] * 6)
            trajs.append(t)
        return TrajectoryGroup(PromptSample(PromptId(0, seed), prompt), 0, trajs)

    def run(module):
        module.begin_rollout_step(0)
        opt = torch.optim.AdamW(module.policy.parameters(), lr=1e-2)
        out = []
        for call in range(2):
            loss = module.training_step(RolloutBatch(groups=[group(call)], rollout_step=0, call_index=call,
                                                     calls_per_step=2), call)
            loss.backward()
            module.on_before_optimizer_step(opt)
            assert module.rollout_metrics()["train/grad_norm"] > 0.1  # so the clipping below clips
            if module is sharded:
                module.configure_gradient_clipping(opt, 0.1, "norm")
            else:
                torch.nn.utils.clip_grad_norm_(module.policy.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
            out.append((loss.item(), dict(module.rollout_metrics())))
        return out

    args = RLPolicyModule.algorithm_args(FasyncConfig())
    sharded, plain = RLPolicyModule("tiny", **args), RLPolicyModule("tiny", **args)
    keys = list(sharded.state_dict())
    sharded._device_mesh = mesh  # what ModelParallelStrategy sets before configure_model
    sharded.configure_model()
    sharded.configure_model()  # Lightning may call it again: still sharded once
    assert isinstance(sharded.policy, FSDPModule) and list(sharded.state_dict()) == keys
    plain.configure_model()  # no mesh: nothing changes
    assert not isinstance(plain.policy, FSDPModule)
    # Both DP ranks train the same data, so the averaged gradient is the single-process one.
    for (loss, metrics), (ref_loss, ref_metrics) in zip(run(sharded), run(plain)):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        for key, value in ref_metrics.items():
            if key.startswith("train/") and key != "train/lr" and math.isfinite(value):
                assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    trained = sharded.policy.state_dict()
    for name, p in plain.policy.state_dict().items():
        torch.testing.assert_close(_full(trained[name]), p, rtol=1e-4, atol=1e-5, msg=name)


def _data_parallel_checks(rank: int) -> None:
    mesh = _mesh(2, 1)
    # The same batch split in halves over the 2 ranks: the averaged gradient is the single-process
    # gradient of the mean loss (with activation checkpointing, FSDP gathering inside its recompute).
    _check_against_single_process(_tiny, mesh, rank, 2, activation_checkpointing=True)
    _check_against_single_process(_qwen3, mesh, rank, 2)
    # Mixed precision: bf16 compute, float32 parameters and gradients.
    model = shard_policy(_tiny(), mesh, mixed_precision="bf16")
    ids = torch.randint(4, 60, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(logits.float(), _tiny()(input_ids=ids).logits, rtol=0.05, atol=0.15)
    logits.float().square().mean().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    _snapshot_checks(rank, mesh)
    _module_checks(rank, mesh)


@pytest.mark.slow
def test_fsdp_data_parallel_matches_single_process():
    run_ranks(_data_parallel_checks)


# ---------------------------------------------------------------------------------------- refusals


def test_tp_sizes_the_heads_cannot_split_over_are_refused():
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    def qwen2(heads: int, kv_heads: int, intermediate: int = 256):
        return Qwen2Config(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate)

    assert tp_head_layout(qwen2(4, 1), 2) == "replicated_kv"
    assert tp_head_layout(qwen2(8, 2), 4) == "replicated_kv"
    assert tp_head_layout(LlamaConfig(num_attention_heads=8, num_key_value_heads=4, intermediate_size=256), 2) == "sharded"
    with pytest.raises(ConfigError, match=r"`tensor_parallel_size` is 3, which does not divide the policy's 4 attention"):
        tp_head_layout(qwen2(4, 1, 240), 3)
    with pytest.raises(ConfigError, match=r"`tensor_parallel_size` is 4 with 12 attention heads and 3 key/value heads; "
                                          r"it must divide num_key_value_heads or be a multiple of it"):
        tp_head_layout(qwen2(12, 3), 4)
    with pytest.raises(ConfigError, match=r"`tensor_parallel_size` is 4, which does not divide .* intermediate_size 250"):
        tp_head_layout(qwen2(4, 4, 250), 4)
    with pytest.raises(ConfigError, match=r"model type 'gpt2' has no tensor-parallel plan"):
        tp_head_layout(GPT2Config(), 2)


def test_bad_mixed_precision_and_mesh_are_refused():
    from lightning_fasync.lightning.module import RLPolicyModule

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"`mixed_precision` is 'fp8'; it must be null or one of bf16, fp16"):
        shard_policy(model, None, mixed_precision="fp8")
    with pytest.raises(ConfigError, match=r"`model.mixed_precision` is 'bf16-mixed'"):
        RLPolicyModule("tiny", mixed_precision="bf16-mixed")
    with pytest.raises(ConfigError, match=r"needs ModelParallelStrategy's \('data_parallel', 'tensor_parallel'\) mesh"):
        shard_policy(model, types.SimpleNamespace(mesh_dim_names=("dp",)))


def test_clip_grad_norm_of_plain_gradients_is_torchs():
    from lightning_fasync.algorithms import clip_grad_norm, total_grad_norm

    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    ours[2].grad = theirs[2].grad = None
    assert total_grad_norm([ours[2]]).item() == 0.0
    assert torch.equal(clip_grad_norm(ours, 0.5), torch.nn.utils.clip_grad_norm_(theirs, 0.5))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours[:2], theirs[:2]))

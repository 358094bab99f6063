"""megatron-core checkpoints (``lightning_fasync.trainers.megatron.checkpoint``) on CPU.

The slow test trains real ``GPTModel`` chunks on 2 spawned gloo ranks (``tests/helpers/megatron_cpu.py``'s
``run_ranks``, under ``cpu_training_shim``) with megatron-core's DDP, distributed optimizer and
``get_forward_backward_func``: a checkpoint written through ``CheckpointFiles`` at DP=2 resumes
bit-exactly (parameters, optimizer state, the next step), in either optimizer format; one written at
TP=2 resumes at DP=2 with the same function and the same next step; megatron-core's non-distributed
optimizer resumes too; ``lightning-fasync export`` (in this process, no shim) writes the saved
weights as a Hugging Face directory that transformers loads. The fast test does a model-only
checkpoint in one process: resume, export, and the refusal of another model's shape.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.helpers.megatron_cpu import (
    cpu_training_shim, require_megatron, run_ranks, single_process_parallel_state, tiny_hf_config, tiny_hf_model,
)

require_megatron()

from lightning_fasync.config import ConfigError  # noqa: E402
from lightning_fasync.trainers.megatron import checkpoint as mcheckpoint  # noqa: E402
from lightning_fasync.trainers.megatron import convert  # noqa: E402

FAMILY = "qwen3"  # tied embeddings, q/k norms, GQA
B, L = 4, 8


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex/Transformer Engine not installed", DCP deprecations
        yield


def _hf_dir(path, family=FAMILY) -> str:
    """The tiny HF model with the char tokenizer, as the directory the module was built from."""
    from lightning_fasync.policy import build_char_tokenizer, save_policy

    save_policy(tiny_hf_model(family), build_char_tokenizer(), str(path))
    return str(path)


def _build(cfg, seed=0):
    from megatron.core import parallel_state

    from lightning_fasync.trainers.megatron.model import build_gpt_model

    torch.manual_seed(seed)  # the same on every rank: each cuts its shard of the same full weights
    return build_gpt_model(cfg, use_cpu_initialization=True, params_dtype=torch.float32,
                           tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size())


def _hf_weights(model) -> dict[str, torch.Tensor]:
    return convert.megatron_to_hf(model.state_dict(), tiny_hf_config(FAMILY))


def _tensors(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------ one process


def test_model_only_checkpoint_exports_and_refuses_another_models_shape(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from lightning_fasync.cli import main
    from lightning_fasync.trainers.megatron.model import load_hf_weights

    hf_dir = _hf_dir(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir)
    ckpt = str(tmp_path / "step-000001.ckpt")
    with single_process_parallel_state():
        model = _build(hf.config)
        load_hf_weights(model, hf.state_dict(), hf.config)
        with cpu_training_shim():  # the torch_dist writer synchronizes CUDA before writing
            mcheckpoint.save_checkpoint(ckpt, [model], None, {"hyper_parameters": {"model": hf_dir}, "epoch": 0})
        info = mcheckpoint.read_info(ckpt)  # no hf_config given: export reads the `model` hyperparameter's
        assert (info["layer_spec"], info["params_dtype"], info["optimizer"], info["hf_config"]) == (
            "local", "float32", None, None)
        assert info["parallel"]["tensor_model_parallel_size"] == 1 and os.path.isfile(os.path.join(ckpt, "meta.pt"))

        fresh = _build(hf.config, seed=1)
        meta = mcheckpoint.load_checkpoint(ckpt, [fresh])
        assert meta == {"hyper_parameters": {"model": hf_dir}, "epoch": 0}
        _assert_equal(_tensors(fresh), _tensors(model))

        other = _build(tiny_hf_config("llama"))  # no q/k norms
        with pytest.raises(ConfigError, match=r"^`model\.model` builds a policy whose shape differs .* \(first "
                                              r"difference: 'decoder\.layers\.self_attention\.k_layernorm\.weight'"):
            mcheckpoint.load_checkpoint(ckpt, [other])

    # No process group is left; export makes and removes its own, reading the link as fit's `last` does.
    os.symlink(os.path.basename(ckpt), tmp_path / "last.ckpt")
    out = tmp_path / "exported"
    assert main(["export", "--ckpt_path", str(tmp_path / "last.ckpt"), "--out", str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out)
    _assert_equal(exported.state_dict(), hf.state_dict())
    assert not torch.distributed.is_initialized()

    # A --model of another shape (this checkpoint records no config) is refused before any weight is read.
    llama = _hf_dir(tmp_path / "llama", "llama")
    capsys.readouterr()
    assert main(["export", "--ckpt_path", ckpt, "--out", str(tmp_path / "o2"), "--model", llama]) == 2
    err = capsys.readouterr().err
    assert "`--model` builds a policy whose shape differs" in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "o2") and not torch.distributed.is_initialized()


# ------------------------------------------------------------------------------ 2 ranks


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (B, L), generator=g), torch.randint(0, 96, (B, L), generator=g)


def _token_losses(model, batch) -> torch.Tensor:
    """Per-token cross entropy [B, L]: the whole model's function (vocab-parallel under TP)."""
    ids, labels = batch
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool)).logical_not()[None, None]
    with torch.no_grad():
        return model(ids, torch.arange(L)[None].expand(len(ids), L), mask, labels=labels)


def _pieces(cfg, seed=0, hf=None, distributed=True):
    """A chunk and optimizer as MegatronStrategy builds them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from lightning_fasync.trainers.megatron.model import load_hf_weights

    model = _build(cfg, seed)
    if hf is not None:
        load_hf_weights(model, hf.state_dict(), cfg)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True),
        model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed,
                                                 bf16=False), [ddp])
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp, opt


def _step(ddp, opt, batch) -> None:
    """One training step on this data-parallel rank's share of ``batch``."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = B // dp
    ids, labels = (t[rank * share:(rank + 1) * share] for t in batch)
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool)).logical_not()[None, None]

    def loss_func(token_losses):
        loss = token_losses.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(iterator, model):
        next(iterator)
        return model(ids, torch.arange(L)[None].expand(share, L), mask, labels=labels), loss_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[ddp],
                                num_microbatches=1, seq_length=L, micro_batch_size=share, forward_only=False)
    ok, _, _ = opt.step()
    assert ok


def _optimizer_state(opt) -> dict[str, torch.Tensor]:
    out = {}
    for i, part in enumerate(opt.chained_optimizers):
        for g, group in enumerate(part.optimizer.param_groups):
            for p, param in enumerate(group["params"]):
                out[f"{i}.{g}.{p}.param"] = param.detach().clone()
                for k, v in part.optimizer.state[param].items():
                    out[f"{i}.{g}.{p}.{k}"] = torch.as_tensor(v).clone()
    return out


def _layouts(rank: int, root: str, hf_dir: str) -> None:
    from megatron.core import parallel_state

    from lightning_fasync.runtime.checkpoints import CheckpointFiles

    cfg = tiny_hf_config(FAMILY)
    meta = {"hyper_parameters": {"model": hf_dir}, "global_step": 1, "optimizer_states": [],
            "fasync_identity": {"config": {"trainer.mini_batch_size": 4}, "model_shape": {"x": [96, 32]}}}
    first, second = _batch(1), _batch(2)

    # DP=2: started from the HF weights, one step, saved through CheckpointFiles (each rank's temporary
    # name differs; rank 0's is used) and in the dp_reshardable format, each resumed in this layout.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    ddp, opt = _pieces(cfg, hf=tiny_hf_model(FAMILY))
    _step(ddp, opt, first)
    if rank == 0:
        torch.save(_hf_weights(ddp.module), os.path.join(root, "expected.pt"))
    files = CheckpointFiles(os.path.join(root, "checkpoints"), keep_last=1)
    files.save(1, lambda path: mcheckpoint.save_checkpoint(path, [ddp], opt, dict(meta), hf_config=cfg), rank == 0)
    dp_path = os.path.join(root, "dp.ckpt")
    mcheckpoint.save_checkpoint(dp_path, [ddp], opt, dict(meta), optimizer_format="dp_reshardable")
    saved, saved_state = _tensors(ddp.module), _optimizer_state(opt)
    _step(ddp, opt, second)

    for path in (files.last(), dp_path):
        again, again_opt = _pieces(cfg, seed=1)
        loaded = mcheckpoint.load_checkpoint(path, [again], again_opt)
        assert loaded == meta
        _assert_equal(_tensors(again.module), saved)
        _assert_equal(_optimizer_state(again_opt), saved_state)
        _step(again, again_opt, second)
        _assert_equal(_tensors(again.module), _tensors(ddp.module))
    parallel_state.destroy_model_parallel()

    # TP=2: one step, saved; the function before and after a second step is the reference.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    ddp, opt = _pieces(cfg, seed=2)
    _step(ddp, opt, first)
    tp_path = os.path.join(root, "tp2.ckpt")
    mcheckpoint.save_checkpoint(tp_path, [ddp], opt, dict(meta), hf_config=cfg)
    before, probe = _token_losses(ddp, second), _batch(3)
    _step(ddp, opt, second)
    after = _token_losses(ddp, probe)
    assert mcheckpoint.read_info(tp_path)["parallel"]["tensor_model_parallel_size"] == 2
    with pytest.raises(ConfigError, match=r"^`trainer\.strategy\.init_args\.tensor_model_parallel_size` is 2 .*"
                                          r"dp_reshardable, which resumes with another data-parallel size only"):
        mcheckpoint.load_checkpoint(dp_path, [ddp], opt)

    # Without the distributed optimizer (megatron-core's FP32Optimizer here): resumed exactly; the
    # distributed one refuses its state, naming the strategy's key.
    plain, plain_opt = _pieces(cfg, seed=4, distributed=False)
    _step(plain, plain_opt, first)
    plain_path = os.path.join(root, "plain.ckpt")
    mcheckpoint.save_checkpoint(plain_path, [plain], plain_opt, dict(meta))
    saved, saved_state = _tensors(plain.module), _optimizer_state(plain_opt)
    _step(plain, plain_opt, second)
    again, again_opt = _pieces(cfg, seed=5, distributed=False)
    mcheckpoint.load_checkpoint(plain_path, [again], again_opt)
    _assert_equal(_tensors(again.module), saved)
    _assert_equal(_optimizer_state(again_opt), saved_state)
    _step(again, again_opt, second)
    _assert_equal(_tensors(again.module), _tensors(plain.module))
    with pytest.raises(ConfigError, match=r"^`trainer\.strategy\.init_args\.use_distributed_optimizer` is True "):
        mcheckpoint.load_checkpoint(plain_path, [ddp], opt)
    parallel_state.destroy_model_parallel()

    # DP=2 resumes the TP=2 checkpoint: the same function, and the same second step (each DP rank
    # on half the batch; fp32 sums in another order, hence the tolerance).
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    with pytest.raises(ConfigError, match=r"`model\.model` builds a policy whose shape differs"):
        mcheckpoint.load_checkpoint(tp_path, [_build(tiny_hf_config("llama"))])  # every rank refuses
    ddp, opt = _pieces(cfg, seed=3)
    mcheckpoint.load_checkpoint(tp_path, [ddp], opt)
    torch.testing.assert_close(_token_losses(ddp, second), before, rtol=1e-5, atol=1e-5)
    _step(ddp, opt, second)
    torch.testing.assert_close(_token_losses(ddp, probe), after, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_resume_in_the_same_and_another_layout_and_export(tmp_path):
    from transformers import AutoModelForCausalLM

    from lightning_fasync.export.hf import export_checkpoint

    hf_dir = _hf_dir(tmp_path / "hf")
    run_ranks(_layouts, 2, str(tmp_path), hf_dir)

    out = export_checkpoint(str(tmp_path / "checkpoints" / "last.ckpt"), str(tmp_path / "exported"))
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not torch.equal(expected["model.norm.weight"], tiny_hf_model(FAMILY).state_dict()["model.norm.weight"])
    _assert_equal({k: v for k, v in exported.state_dict().items() if k != "lm_head.weight"}, expected)
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()  # tied

"""MegatronStrategy and MegatronPolicyModule without spawning ranks: the refusals (one sentence
naming the key), the CLI's choice of policy class, the vocab-parallel log-probs against
``log_softmax``, the optimizer adapter's shared parameter groups, and the layout-free run identity."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.megatron_cpu import require_megatron, single_process_parallel_state
from tests.helpers.paths import REPO

require_megatron()

from lightning_fasync.config import AlgorithmConfig, ConfigError, FasyncConfig, ReferenceConfig  # noqa: E402
from lightning_fasync.runtime.checkpoints import run_identity  # noqa: E402
from lightning_fasync.lightning.cli import policy_class  # noqa: E402
from lightning_fasync.lightning.module import RLPolicyModule  # noqa: E402
from lightning_fasync.trainers.megatron import MegatronPolicyModule, MegatronStrategy  # noqa: E402


def test_strategy_refuses_what_it_cannot_run_naming_the_key():
    with pytest.raises(ConfigError, match=r"`trainer\.strategy\.init_args\.context_parallel_size` is 2"):
        MegatronStrategy(context_parallel_size=2)
    with pytest.raises(ConfigError, match=r"`trainer\.strategy\.init_args\.sequence_parallel` is true; .* local layer"):
        MegatronStrategy(tensor_model_parallel_size=2, sequence_parallel=True)


def test_layout_is_checked_against_the_world_size_before_any_process_group():
    import lightning.pytorch as pl
    import torch.distributed as dist

    strategy = MegatronStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)  # sets the devices
    with pytest.raises(ConfigError, match=r"2 x 2 x 1 = 4, which does not divide the world size 2"):
        strategy.setup_distributed()
    assert not dist.is_initialized()


def test_the_cli_builds_the_megatron_policy_under_megatron_strategy(tmp_path):
    assert policy_class(["fit", "--config", "configs/tiny_cpu.yaml"]) is RLPolicyModule
    assert policy_class(["fit", "--trainer.strategy=MegatronStrategy"]) is MegatronPolicyModule
    assert policy_class(["fit", "--trainer.strategy", "megatron"]) is MegatronPolicyModule
    cfg = tmp_path / "run.yaml"
    cfg.write_text("trainer:\n  strategy:\n    class_path: lightning_fasync.trainers.megatron.MegatronStrategy\n"
                   "    init_args: {tensor_model_parallel_size: 2}\n")
    assert policy_class(["fit", "--config", "configs/tiny_cpu.yaml", "-c", str(cfg)]) is MegatronPolicyModule
    # The command line wins over the config files.
    assert policy_class(["fit", "--config", str(cfg), "--trainer.strategy=ddp"]) is RLPolicyModule


def test_module_refusals():
    with pytest.raises(ConfigError, match=r"`model\.micro_batch_size` is 0"):
        MegatronPolicyModule("tiny", micro_batch_size=0)
    with pytest.raises(ConfigError, match=r"`model\.grad_clip` is -1"):
        MegatronPolicyModule("tiny", grad_clip=-1.0)
    with pytest.raises(ConfigError, match=r"`algorithm\.reference\.model` is 'policy'; MegatronPolicyModule"):
        MegatronPolicyModule("tiny", algorithm=AlgorithmConfig(reference=ReferenceConfig(model="policy")))
    module = MegatronPolicyModule("tiny", micro_batch_size=3)
    assert module.automatic_optimization is False and len(module.policy) == 0  # chunks come in configure_model
    with pytest.raises(ConfigError, match=r"`model\.micro_batch_size` is 3, which does not divide .* 8 sequences"):
        module._micro_batches(8)
    assert module._micro_batches(9) == (3, 3)


def test_run_identity_is_the_hf_shape_whatever_the_layout():
    # A resume may change the parallel layout: the identity records the HF (global) shapes, which
    # are RLPolicyModule's for the same model.
    cfg = FasyncConfig()
    mega = run_identity(cfg, MegatronPolicyModule("tiny"))["model_shape"]
    hf = run_identity(cfg, RLPolicyModule("tiny"))["model_shape"]
    assert mega == hf and "policy.model.layers.2.mlp.down_proj.weight" in mega


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_parallel_log_probs_equal_log_softmax(temperature):
    from lightning_fasync.trainers.megatron.module import vocab_parallel_log_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g).requires_grad_()
    target = torch.randint(0, 11, (2, 5), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with single_process_parallel_state(tensor_model_parallel_size=1):
            lp, ent = vocab_parallel_log_probs(logits, target, temperature, with_entropy=True, entropy_grad=True)
    ref_all = torch.log_softmax(logits.float() / temperature, -1)
    ref = ref_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    torch.testing.assert_close(lp, ref)
    torch.testing.assert_close(ent, ref_ent)
    (g1,) = torch.autograd.grad((lp.sum() + ent.sum()), logits)
    (g2,) = torch.autograd.grad((ref.sum() + ref_ent.sum()), logits)
    torch.testing.assert_close(g1, g2)


def test_optimizer_adapter_shares_megatrons_param_groups():
    from lightning_fasync.trainers.megatron.module import MegatronOptimizer

    class Fake:  # the part of megatron-core's optimizer the adapter touches
        def __init__(self):
            self.param_groups = [{"params": [torch.zeros(2)], "lr": 0.5}]
            self.steps = 0

        def step(self):
            self.steps += 1
            return True, 2.5, None

        def zero_grad(self, set_to_none=True):
            pass

    fake = Fake()
    opt = MegatronOptimizer(fake)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1 * (step + 1))
    assert fake.param_groups[0]["lr"] == pytest.approx(0.05)  # the scheduler set megatron-core's lr
    calls = []
    opt.step(lambda: calls.append(1))
    scheduler.step()
    assert calls == [1] and fake.steps == 1 and opt.last_grad_norm == 2.5
    assert fake.param_groups[0]["lr"] == pytest.approx(0.1)
    with pytest.raises(RuntimeError, match="dist_checkpointing"):
        opt.state_dict()


def test_the_qwen3_30b_config_trains_with_megatron_in_a_layout_that_validates():
    import os

    import yaml
    from transformers import Qwen3MoeConfig

    from lightning_fasync.trainers.megatron.parallel import validate_for_model

    path = os.path.join(REPO, "configs", "qwen3_30b_a3b", "dapo_h20_1node.yaml")
    data = yaml.safe_load(open(path))
    assert policy_class(["fit", "--config", path]) is MegatronPolicyModule
    strategy = MegatronStrategy(**data["trainer"]["strategy"]["init_args"])
    assert "precision" not in data["trainer"] and "gradient_clip_val" not in data["trainer"]
    # Qwen3-30B-A3B's published shape.
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                         moe_intermediate_size=768, norm_topk_prob=True)
    world = data["trainer"]["devices"] * data["trainer"]["num_nodes"]
    assert validate_for_model(strategy.sizes, world, cfg) == 8  # EP 8 over DP 8 (TP 1: MoE under TP needs SP)
    assert strategy.sizes.tensor_model_parallel_size == 1
    assert cfg.vocab_size % strategy.sizes.tensor_model_parallel_size == 0
    module_args = MegatronPolicyModule.__init__.__code__.co_varnames
    assert all(key in module_args for key in data["model"])  # every model.* key is the module's


def test_lightning_precision_is_refused_for_megatrons_own():
    import lightning.pytorch as pl

    strategy = MegatronStrategy()
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", logger=False)
    with pytest.raises(ConfigError, match=r"`trainer\.precision` is 'bf16-mixed'.*`model\.mixed_precision: bf16`"):
        strategy.setup_distributed()


def test_the_cli_asks_for_megatrons_clipping_instead_of_lightnings(capsys):
    from lightning_fasync.cli import main

    assert main(["fit", "--config", "configs/tiny_cpu.yaml", "--trainer.strategy=MegatronStrategy",
                 "--trainer.accelerator=cpu"]) == 2
    err = capsys.readouterr().err
    assert "`trainer.gradient_clip_val` is 1.0 under MegatronStrategy" in err and "`model.grad_clip: 1.0`" in err


def test_colocate_offload_uses_megatrons_own_offload_and_leaves_cpu_alone():
    from lightning_fasync.trainers.megatron.module import MegatronOptimizer, _optimizer_parts

    class Part:
        param_groups = [{"params": [], "lr": 1.0}]

    chained = type("Chained", (), {"param_groups": Part.param_groups, "chained_optimizers": [Part(), Part()]})()
    single = Part()
    assert _optimizer_parts([MegatronOptimizer(chained)]) == chained.chained_optimizers
    assert _optimizer_parts([MegatronOptimizer(single), torch.optim.SGD([torch.zeros(1, requires_grad=True)])]) == [single]
    module = MegatronPolicyModule("tiny")
    module.offload_train([])  # on CPU nothing moves (and no chunk is touched)
    module.onload_train([])

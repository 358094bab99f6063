"""RLPolicyModule's batch assembly: response positions line up with the logits that predict them."""

import math

import pytest
import torch

from lightning_fasync.lightning.batch import collate_groups
from lightning_fasync.lightning.module import RLPolicyModule, token_log_probs
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus


def traj(prompt, response, versions, reward, index):
    t = Trajectory(prompt_id=PromptId(0, 0), sample_index=index, prompt_ids=prompt, status=TrajectoryStatus.COMPLETED, reward=reward)
    t.extend(response, [-0.5 - i for i in range(len(response))], versions)
    return t


def test_collate_aligns_response_tokens_with_their_predicting_positions():
    module = RLPolicyModule("tiny")
    sample = PromptSample(PromptId(0, 0), [1, 10, 11])
    group = TrajectoryGroup(sample, 0, [traj([1, 10, 11], [20, 21, 2], [0, 0, 1], 1.0, 0), traj([1, 10, 11], [22], [1], float("nan"), 1)])
    batch = collate_groups([group], module.tokenizer.pad_token_id)
    assert batch.input_ids.tolist() == [[1, 10, 11, 20, 21, 2], [1, 10, 11, 22, 0, 0]]
    # Position t predicts token t + 1: the response starts being predicted at len(prompt) - 1.
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert batch.rollout_log_probs[0, 2:].tolist() == [-0.5, -1.5, -2.5]
    assert batch.weight_versions.tolist() == [[-1, -1, 0, 0, 1], [-1, -1, 1, -1, -1]]
    assert batch.rewards.shape == (1, 2) and math.isnan(batch.rewards[0, 1])

    log_probs, entropy = token_log_probs(module.policy, batch, with_entropy=True)
    with torch.no_grad():
        logits = module.policy(input_ids=batch.input_ids[:1]).logits[0].float()
    expected = [torch.log_softmax(logits[p], -1)[tok].item() for p, tok in [(2, 20), (3, 21), (4, 2)]]
    assert torch.allclose(log_probs[0, 2:5], torch.tensor(expected), atol=1e-5)
    assert not entropy.requires_grad and torch.all(entropy >= 0)
    # At the rollout temperature T the log-probs are of logits / T, as the engines report them.
    hot, _ = token_log_probs(module.policy, batch, temperature=0.5)
    expected = [torch.log_softmax(logits[p] / 0.5, -1)[tok].item() for p, tok in [(2, 20), (3, 21), (4, 2)]]
    assert torch.allclose(hot[0, 2:5], torch.tensor(expected), atol=1e-5)


def test_training_step_gives_a_finite_loss_and_the_train_metrics():
    from lightning_fasync.config import FasyncConfig
    from lightning_fasync.lightning.batch import RolloutBatch

    module = RLPolicyModule("tiny", **RLPolicyModule.algorithm_args(FasyncConfig()))
    sample = PromptSample(PromptId(0, 0), [1, 10, 11])
    group = TrajectoryGroup(sample, 0, [traj([1, 10, 11], [20, 21, 2], [0, 0, 0], r, i) for i, r in enumerate([1.0, 0.0, 0.5, 0.25])])
    module.begin_rollout_step(0)
    loss = module.training_step(RolloutBatch(groups=[group]), 0)
    assert torch.isfinite(loss) and loss.requires_grad
    loss.backward()
    module.on_before_optimizer_step(None)
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/clip_ratio", "train/nan_ratio",
                "perf/train_memory_allocated_max"):
        assert math.isfinite(module.rollout_metrics()[key]), key


def test_the_module_refuses_a_plugin_config_it_was_not_built_with():
    from lightning_fasync.config import ConfigError, load_config

    cfg = load_config({"algorithm": {"m2po": {"enable": True}}})
    module = RLPolicyModule("tiny")  # built with the default algorithm: M2PO off
    with pytest.raises(ConfigError, match="`algorithm` in the plugin config"):
        module.check_fasync_config(cfg)
    cfg = load_config({"rollout": {"temperature": 0.7}})
    with pytest.raises(ConfigError, match="`rollout.temperature` in the plugin config is 0.7"):
        module.check_fasync_config(cfg)
    RLPolicyModule("tiny", **RLPolicyModule.algorithm_args(cfg)).check_fasync_config(cfg)
    RLPolicyModule("tiny", **RLPolicyModule.algorithm_args(cfg)).check_fasync_config(cfg)
    masked = load_config({"rollout": {"partial": True, "mask_offpolicy_in_partial_rollout": True}})
    with pytest.raises(ConfigError, match="`rollout.mask_offpolicy_in_partial_rollout`"):
        module.check_fasync_config(masked)


def test_a_module_without_the_contract_is_refused_by_both_drivers():
    import lightning.pytorch as pl

    from lightning_fasync.lightning.hooks import FullyAsyncHooks, require_hooks

    class Plain(pl.LightningModule):
        pass

    with pytest.raises(TypeError, match="class Plain\\(FullyAsyncHooks"):
        require_hooks(Plain(), "FullyAsyncCallback")

    class Wrapper:  # what Fabric's setup returns: the module behind `.module`
        def __init__(self, module):
            self.module = module

    module = RLPolicyModule("tiny")
    assert require_hooks(Wrapper(module), "FullyAsyncFabricLoop") is module
    assert isinstance(module, FullyAsyncHooks)


def test_lr_schedules_warm_up_and_decay_to_the_floor():
    from lightning_fasync.lightning.module import lr_factor

    cos = lr_factor("cosine", warmup_steps=4, min_lr_ratio=0.1, total_steps=104)
    assert [cos(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos(4) == pytest.approx(1.0) and cos(54) == pytest.approx(0.55) and cos(104) == pytest.approx(0.1)
    assert cos(500) == pytest.approx(0.1)  # past the end: stays at the floor
    lin = lr_factor("linear", warmup_steps=0, min_lr_ratio=0.0, total_steps=10)
    assert [round(lin(s), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert lr_factor("constant", 0, 0.1, 10)(7) == 1.0


def test_bad_schedule_settings_are_refused_naming_the_key():
    from lightning_fasync.config import ConfigError

    with pytest.raises(ConfigError, match="`model.lr_schedule` is 'step'"):
        RLPolicyModule("tiny", lr_schedule="step")
    with pytest.raises(ConfigError, match="`model.min_lr_ratio` 2"):
        RLPolicyModule("tiny", lr_schedule="cosine", min_lr_ratio=2)


def test_training_step_reports_the_version_lag_of_what_it_trained():
    from lightning_fasync.lightning.batch import RolloutBatch

    module = RLPolicyModule("tiny")
    sample = PromptSample(PromptId(0, 0), [1, 10, 11])
    group = TrajectoryGroup(sample, 0, [traj([1, 10, 11], [20, 21, 2], [0, 1, 1], r, i) for i, r in enumerate([1.0, 0.0])])
    module.begin_rollout_step(2)
    module.training_step(RolloutBatch(groups=[group], rollout_step=2), 0)
    m = module.rollout_metrics()
    assert m["train/version_lag_max"] == 2 and m["train/version_lag_min"] == 1
    assert m["train/version_lag_mean"] == pytest.approx(4 / 3)
    assert m["train/lag_1/token_frac"] == pytest.approx(2 / 3) and m["train/lag_2/token_frac"] == pytest.approx(1 / 3)

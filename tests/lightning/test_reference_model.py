"""The frozen reference / teacher model (``algorithm.reference.*``): the KL term it feeds, its
``timing/teacher``, and that it is never trained, checkpointed or sent to the engines."""

import io
import math
import warnings

import pytest
import torch

from lightning_fasync.config import AlgorithmConfig, ConfigError, ConfigWarning, ReferenceConfig, load_config, validate
from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.lightning.module import RLPolicyModule, token_log_probs
from lightning_fasync.pipeline.metrics import aggregate_metrics
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus


def traj(prompt, response, versions, reward, index):
    t = Trajectory(prompt_id=PromptId(0, 0), sample_index=index, prompt_ids=prompt, status=TrajectoryStatus.COMPLETED, reward=reward)
    t.extend(response, [-0.5 - i for i in range(len(response))], versions)
    return t


def group():
    """One group of 4 with responses of different lengths (so the aggregation modes differ)."""
    sample = PromptSample(PromptId(0, 0), [1, 10, 11])
    responses = [[20, 21, 2], [22, 23, 24, 25, 2], [26], [27, 28]]
    return TrajectoryGroup(sample, 0, [traj([1, 10, 11], r, [0] * len(r), rew, i)
                                      for i, (r, rew) in enumerate(zip(responses, [1.0, 0.0, 0.5, 0.25]))])


def module_with(kl_coef=0.0, reference="policy", **kwargs):
    algo = AlgorithmConfig(kl_coef=kl_coef, reference=ReferenceConfig(model=reference, dtype=kwargs.pop("dtype", None)))
    return RLPolicyModule("tiny", algorithm=algo, **kwargs)


def perturb(module, scale=0.05, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def direct_kl(module, data, mode):
    """k3 of KL(pi_theta || pi_ref) over the response tokens, aggregated by hand."""
    with torch.no_grad():
        lp, _ = token_log_probs(module.policy, data, temperature=module.rollout_temperature)
        ref, _ = token_log_probs(module.reference, data, temperature=module.rollout_temperature)
    d = (ref - lp).double()
    k3 = torch.expm1(d) - d
    mask = data.response_mask.bool()
    rows = [k3[i][mask[i]] for i in range(k3.shape[0]) if mask[i].any()]
    if mode == "token-mean":
        return torch.cat(rows).mean().item()
    if mode == "seq-mean-token-sum":
        return sum(r.sum().item() for r in rows) / len(rows)
    return sum(r.mean().item() for r in rows) / len(rows)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_the_kl_term_is_kl_coef_times_k3_over_the_response_tokens(mode):
    c = 0.3
    # A teacher from a preset, at a rollout temperature != 1: both scored at that temperature.
    module = RLPolicyModule("tiny", algorithm=AlgorithmConfig(loss_agg_mode=mode, reference=ReferenceConfig(model="tiny")),
                            rollout_temperature=0.7)
    perturb(module)  # the policy moves away from the (identical, seeded) tiny reference
    g = group()
    data = module.prepare_rollout_batch([g])
    expected = direct_kl(module, data, mode)
    assert expected > 1e-4

    module.begin_rollout_step(0)
    loss0 = module.training_step(RolloutBatch(groups=[g]), 0)
    m0 = dict(module.rollout_metrics())
    module.algorithm = AlgorithmConfig(loss_agg_mode=mode, kl_coef=c, reference=ReferenceConfig(model="tiny"))
    loss_c = module.training_step(RolloutBatch(groups=[g]), 1)
    m_c = dict(module.rollout_metrics())

    assert (loss_c - loss0).item() == pytest.approx(c * expected, rel=1e-4, abs=1e-7)
    # train/ref_kl is the loss's own KL term, reported whatever kl_coef.
    assert m0["train/ref_kl"] == pytest.approx(expected, rel=1e-4)
    assert m_c["train/ref_kl"] == pytest.approx(expected, rel=1e-4)
    assert m_c["train/loss"] == pytest.approx(m_c["train/pg_loss"] + c * m_c["train/ref_kl"], rel=1e-5, abs=1e-7)
    # The gradient of the KL term reaches the policy only.
    loss_c.backward()
    assert all(p.grad is None for p in module.reference.parameters())


def test_a_copy_of_the_initial_policy_starts_at_zero_kl_and_drifts_after_an_update():
    module = module_with(kl_coef=0.1)
    initial = {k: v.clone() for k, v in module.reference.state_dict().items()}
    optimizer = module.configure_optimizers()
    g = group()
    module.begin_rollout_step(0)
    loss = module.training_step(RolloutBatch(groups=[g]), 0)
    assert abs(module.rollout_metrics()["train/ref_kl"]) < 1e-7
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    module.begin_rollout_step(1)
    module.training_step(RolloutBatch(groups=[g]), 1)
    assert module.rollout_metrics()["train/ref_kl"] > 1e-6
    # The reference itself never moved.
    assert all(torch.equal(v, initial[k]) for k, v in module.reference.state_dict().items())
    assert not module.reference.training and not any(p.requires_grad for p in module.reference.parameters())


def test_timing_teacher_is_reported_per_call_and_summed_per_step():
    module = module_with(kl_coef=0.1)
    module.begin_rollout_step(0)
    records = []
    for call in range(2):
        module.training_step(RolloutBatch(groups=[group()]), call)
        records.append(dict(module.rollout_metrics()))
    assert all(r["timing/teacher"] > 0 for r in records)
    step = aggregate_metrics(records)
    assert step["timing/teacher"] == pytest.approx(records[0]["timing/teacher"] + records[1]["timing/teacher"])
    # Without a reference there is neither a teacher timing nor a reference KL.
    plain = RLPolicyModule("tiny")
    plain.begin_rollout_step(0)
    plain.training_step(RolloutBatch(groups=[group()]), 0)
    assert "timing/teacher" not in plain.rollout_metrics() and "train/ref_kl" not in plain.rollout_metrics()


def test_the_reference_is_not_trained_checkpointed_or_sent_to_the_engines():
    module = module_with(kl_coef=0.1)
    plain = RLPolicyModule("tiny")
    ref_params = {id(p) for p in module.reference.parameters()}
    ref_tensors = {t.data_ptr() for t in module.reference.state_dict().values()}
    assert ref_params and not ref_params & {id(p) for p in module.parameters()}
    optimizer = module.configure_optimizers()
    assert not ref_params & {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert set(module.state_dict()) == set(plain.state_dict())
    assert all(k.startswith("policy.") for k in module.state_dict())
    engine = module.engine_state_dict()
    assert set(engine) == set(module.policy.state_dict())
    assert not ref_tensors & {t.data_ptr() for t in engine.values()}
    assert all(name != "_reference" for name, _ in module.named_modules())


def save_load(src, dst):
    buffer = io.BytesIO()
    torch.save({"state_dict": src.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    dst.on_load_checkpoint(checkpoint)
    dst.load_state_dict(checkpoint["state_dict"], strict=True)


def test_checkpoints_load_with_and_without_a_reference():
    trained = module_with(kl_coef=0.1)
    perturb(trained)  # stands for training
    fresh = module_with(kl_coef=0.1)
    initial = {k: v.clone() for k, v in fresh.reference.state_dict().items()}
    save_load(trained, fresh)
    assert all(torch.equal(v, trained.policy.state_dict()[k]) for k, v in fresh.policy.state_dict().items())
    # On resume the reference is still the initial policy, not the checkpoint's.
    assert all(torch.equal(v, initial[k]) for k, v in fresh.reference.state_dict().items())
    plain = RLPolicyModule("tiny")
    save_load(trained, plain)  # with a reference → without
    save_load(plain, module_with(kl_coef=0.1))  # without → with


def test_the_reference_follows_the_module_and_its_dtype_setting():
    module = module_with(dtype="bfloat16")
    assert next(module.reference.parameters()).dtype == torch.bfloat16
    module.begin_rollout_step(0)
    module.training_step(RolloutBatch(groups=[group()]), 0)
    assert math.isfinite(module.rollout_metrics()["train/ref_kl"])
    module = module_with()
    module.double()
    assert next(module.reference.parameters()).dtype == torch.float64
    module.to("cpu")
    assert next(module.reference.parameters()).device == module.device
    with pytest.raises(ConfigError, match="`algorithm.reference.dtype` is 'int8'"):
        module_with(dtype="int8")


def test_kl_coef_without_a_reference_is_refused_naming_both_keys():
    sentence = r"`algorithm.kl_coef` is 0.1 while `algorithm.reference.model` is not set"
    with pytest.raises(ConfigError, match=sentence):
        validate(load_config({"algorithm": {"kl_coef": 0.1}}))
    with pytest.raises(ConfigError, match=sentence):
        RLPolicyModule("tiny", algorithm=AlgorithmConfig(kl_coef=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = validate(load_config({"algorithm": {"kl_coef": 0.1, "reference": {"model": "policy"}}}))
    assert cfg.algorithm.reference.model == "policy"
    # A reference without a KL term is allowed (train/ref_kl monitors drift) but warned about.
    with pytest.warns(ConfigWarning, match="`algorithm.reference.model` is 'policy' while `algorithm.kl_coef` is 0"):
        validate(load_config({"algorithm": {"reference": {"model": "policy"}}}))
    with pytest.raises(ConfigError, match="`algorithm.reference.dtype`"):
        validate(load_config({"algorithm": {"kl_coef": 0.1, "reference": {"model": "policy", "dtype": "fp8"}}}))


def test_a_reference_with_another_vocabulary_is_refused(tmp_path):
    from lightning_fasync.policy import build_policy, save_policy

    model, tokenizer = build_policy("tiny")
    same = save_policy(model, tokenizer, str(tmp_path / "same"))
    module = RLPolicyModule("tiny", algorithm=AlgorithmConfig(kl_coef=0.1, reference=ReferenceConfig(model=same)))
    assert module.reference is not None  # a local directory with the policy's vocabulary
    tokenizer.add_tokens(["<extra>"])
    model.resize_token_embeddings(len(tokenizer))
    other = save_policy(model, tokenizer, str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="`algorithm.reference.model` is .*other.*, whose tokenizer \\(100 tokens\\) is not "
                                          "the policy's \\(99 tokens\\)"):
        RLPolicyModule("tiny", algorithm=AlgorithmConfig(kl_coef=0.1, reference=ReferenceConfig(model=other)))
    with pytest.raises(ConfigError, match="`algorithm.reference.model` is 'nowhere'"):
        RLPolicyModule("tiny", algorithm=AlgorithmConfig(kl_coef=0.1, reference=ReferenceConfig(model="nowhere")))

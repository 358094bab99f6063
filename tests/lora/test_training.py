"""LoRA training through peft (``model.lora``): only the adapters train, the old-actor snapshot holds
them alone and restores them bit-exactly, the reference of ``policy`` is the base with the adapter
disabled. References: peft's own classes and a hand count of the adapters' sizes."""

import copy

import pytest
import torch

from lightning_fasync.config import AlgorithmConfig, ConfigError, LoRAConfig, ReferenceConfig
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.policy import build_policy

TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_module(**kw):
    return RLPolicyModule("tiny", lora={"r": 4, "alpha": 8.0, "target_modules": TARGETS, **kw})


def perturb_adapters(module, seed=0):
    """Give B (zeros at start) values, so the adapter changes the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def test_only_the_adapters_require_grad_and_sit_in_the_optimizer():
    module = lora_module()
    config = build_policy("tiny")[0].config
    trainable = [(n, p) for n, p in module.policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n, _ in trainable)
    # A hand count: per adapted linear r x (in + out); q and v of GQA, down_proj of the MLP.
    head_dim = config.hidden_size // config.num_attention_heads
    shapes = {"q_proj": (config.hidden_size, config.num_attention_heads * head_dim),
              "v_proj": (config.hidden_size, config.num_key_value_heads * head_dim),
              "down_proj": (config.intermediate_size, config.hidden_size)}
    expected = config.num_hidden_layers * sum(4 * (i + o) for i, o in shapes.values())
    assert sum(p.numel() for _, p in trainable) == expected
    optimizer = module.configure_optimizers()
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for _, p in trainable}
    # Full fine-tuning keeps every parameter trainable and in the optimizer.
    full = RLPolicyModule("tiny")
    opt = full.configure_optimizers()
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in full.policy.parameters()}


def test_an_optimizer_step_moves_only_the_adapters():
    module = lora_module()
    base_before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if not p.requires_grad}
    optimizer = module.configure_optimizers()
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    for _ in range(2):
        optimizer.zero_grad()
        out = module.policy(input_ids=ids)
        out.logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).mean().neg().backward()
        optimizer.step()
    after = dict(module.policy.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in base_before.items())
    assert any(p.abs().sum() > 0 for n, p in after.items() if "lora_B" in n)


@pytest.mark.parametrize("lora, message", [
    ({"r": 0}, "`model.lora.r` is 0"),
    ({"alpha": 0.0}, "`model.lora.alpha` is 0.0"),
    ({"dropout": 1.0}, "`model.lora.dropout` is 1.0"),
    ({"sync": "weights"}, "`model.lora.sync` is 'weights'"),
    ({"target_modules": ["qkv_proj"]}, "`model.lora.target_modules` names 'qkv_proj', which matches no linear layer"),
    ({"rank": 4}, "`model.lora.rank` is not a key of model.lora"),
])
def test_bad_values_are_refused_naming_the_key(lora, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        RLPolicyModule("tiny", lora=lora)


def test_a_tied_lm_head_is_refused():
    # qwen3-30m-shape ties lm_head to the embeddings; tiny does not.
    with pytest.raises(ConfigError, match="tied to another parameter"):
        RLPolicyModule("qwen3-30m-shape", lora={"target_modules": ["lm_head"]})
    RLPolicyModule("tiny", lora={"target_modules": ["lm_head"]})  # untied: allowed


def test_the_snapshot_holds_only_the_adapters_and_restores_bit_exactly():
    module = lora_module()
    perturb_adapters(module)
    snap = module.snapshot
    snap.begin_step(1)
    snap.take()
    trainable = [p for p in module.policy.parameters() if p.requires_grad]
    assert len(snap._buffers) == len(trainable)
    assert sum(b.numel() for b in snap._buffers) == sum(p.numel() for p in trainable)
    step_start = [p.detach().clone() for p in module.policy.parameters()]
    perturb_adapters(module, seed=1)  # "an optimizer step"
    live = [p.detach().clone() for p in module.policy.parameters()]
    with snap.use_old_weights() as swapped:
        assert swapped
        assert all(torch.equal(p, s) for p, s in zip(module.policy.parameters(), step_start))
    assert all(torch.equal(p, s) for p, s in zip(module.policy.parameters(), live))


def test_the_reference_of_policy_is_the_base_with_the_adapter_disabled():
    algo = AlgorithmConfig(kl_coef=0.1, reference=ReferenceConfig(model="policy"))
    module = RLPolicyModule("tiny", algorithm=algo, lora=LoRAConfig(r=4, target_modules=TARGETS))
    params_before = sum(1 for _ in module.parameters())
    assert not module.reference._parameters and not list(module.reference.children())  # no copy of the weights
    assert any(p.requires_grad for p in module.policy.parameters())  # building it froze nothing
    perturb_adapters(module)
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    base = build_policy("tiny")[0].eval()  # the preset rebuilt: the independent reference
    module.policy.train()
    with torch.no_grad():
        ref_logits = module.reference(input_ids=ids).logits
        adapted = module.policy(input_ids=ids).logits
        expected = base(input_ids=ids).logits
    torch.testing.assert_close(ref_logits, expected, rtol=0, atol=1e-6)
    # Packed forwards (position_ids) of the reference, as trainer.pack_sequences runs them.
    from lightning_fasync.lightning.batch import check_packed_attention

    check_packed_attention(module.reference)
    packed = torch.tensor([[1, 40, 41, 1, 42, 43]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with torch.no_grad():
        torch.testing.assert_close(module.reference(input_ids=packed, position_ids=positions).logits,
                                   base(input_ids=packed, position_ids=positions).logits, rtol=0, atol=1e-6)
    assert (adapted - expected).abs().max() > 1e-3  # the adapter is on for the policy itself
    assert module.policy.training  # put back after the reference's eval-mode forward
    assert sum(1 for _ in module.parameters()) == params_before
    # Another dtype: a merged copy of the base in that dtype.
    algo16 = AlgorithmConfig(kl_coef=0.1, reference=ReferenceConfig(model="policy", dtype="bfloat16"))
    module16 = RLPolicyModule("tiny", algorithm=algo16, lora={"r": 4, "target_modules": TARGETS})
    assert next(module16.reference.parameters()).dtype == torch.bfloat16
    assert not any("lora" in n for n, _ in module16.reference.named_parameters())


def test_merge_and_unload_of_a_copy_leaves_the_trained_module_alone():
    # The test below relies on it: peft's merge_and_unload on a deepcopy, as a reference.
    module = lora_module()
    perturb_adapters(module)
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    copy.deepcopy(module.policy).merge_and_unload()
    assert all(torch.equal(p, before[n]) for n, p in module.policy.named_parameters())

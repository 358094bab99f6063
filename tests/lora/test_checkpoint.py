"""A LoRA module's checkpoint holds only the adapter (and a fingerprint of its base), and a resume
from it (``torch.load(weights_only=True)``, then the hooks Lightning and Fabric call) gives the
same parameters and the same next-step loss as the run that saved it."""

import pytest
import torch

from lightning_fasync.config import ConfigError
from lightning_fasync.lightning.module import LORA_FINGERPRINT_KEY, RLPolicyModule
from lightning_fasync.lora import base_fingerprint

LORA = {"r": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "gate_proj"]}
IDS = torch.tensor([[1, 40, 41, 42, 43, 44, 45], [1, 50, 51, 52, 53, 2, 0]])


def loss_of(module):
    logits = module.policy(input_ids=IDS).logits[:, :-1]
    return logits.log_softmax(-1).gather(-1, IDS[:, 1:, None]).mean().neg()


def train(module, optimizer, steps, seed):
    torch.manual_seed(seed)  # the adapters' dropout masks
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(module).backward()
        optimizer.step()


def test_the_checkpoint_holds_only_the_adapter_and_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    module = RLPolicyModule("tiny", lora=LORA)
    optimizer = module.configure_optimizers()
    train(module, optimizer, 3, seed=1)
    state = module.state_dict()
    trainable = {f"policy.{n}" for n, p in module.policy.named_parameters() if p.requires_grad}
    assert set(state) == trainable | {LORA_FINGERPRINT_KEY}
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": state, "optimizer": optimizer.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    full_bytes = sum(t.numel() * t.element_size() for t in module.policy.state_dict().values())
    assert path.stat().st_size < full_bytes / 5  # the base is not in it

    ckpt = torch.load(path, weights_only=True)
    torch.manual_seed(123)  # another init of A than the saved run's: the checkpoint must win
    resumed = RLPolicyModule("tiny", lora=ckpt["hyper_parameters"]["lora"])
    resumed.on_load_checkpoint(ckpt)
    resumed.load_state_dict(ckpt["state_dict"])
    opt2 = resumed.configure_optimizers()
    opt2.load_state_dict(ckpt["optimizer"])
    for (n, a), (m, b) in zip(module.policy.named_parameters(), resumed.policy.named_parameters()):
        assert n == m and torch.equal(a, b), n
    # The same next step: same loss, same parameters after it.
    train(module, optimizer, 1, seed=7)
    train(resumed, opt2, 1, seed=7)
    with torch.no_grad():
        torch.manual_seed(9)
        a = loss_of(module)
        torch.manual_seed(9)
        b = loss_of(resumed)
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(module.policy.parameters(), resumed.policy.parameters()))


def test_a_checkpoint_over_another_base_or_without_lora_is_refused():
    module = RLPolicyModule("tiny", lora=LORA)
    state = module.state_dict()
    other = RLPolicyModule("tiny", lora=LORA)
    with torch.no_grad():
        next(p for p in other.policy.parameters() if not p.requires_grad).add_(1.0)  # another base
    # ...as a module built over it has it (the fingerprint is taken when the policy is built).
    other._lora_fingerprint = torch.frombuffer(bytearray.fromhex(base_fingerprint(other.policy)), dtype=torch.uint8)
    with pytest.raises(ConfigError, match="not the base the checkpoint's LoRA adapter was trained on"):
        other.load_state_dict(state)
    full = RLPolicyModule("tiny")
    with pytest.raises(ConfigError, match=r"`model.lora` is null, but the checkpoint was trained with LoRA adapters"):
        full.on_load_checkpoint({"state_dict": state})
    with pytest.raises(ConfigError, match=r"`model.lora` is set, but the checkpoint was trained without them"):
        module.on_load_checkpoint({"state_dict": full.state_dict()})
    bigger = RLPolicyModule("tiny", lora={**LORA, "r": 8})
    with pytest.raises(ConfigError, match="`model.lora` is .* differs in shape"):
        bigger.on_load_checkpoint({"state_dict": state})


def test_a_checkpoint_of_a_module_cast_by_its_precision_loads_into_a_fresh_module():
    """Lightning restores a checkpoint before its precision plugin casts the module (``bf16-true``),
    and export rebuilds the base in the default dtype: the fingerprint is the base's as built."""
    module = RLPolicyModule("tiny", lora=LORA)
    with torch.no_grad():  # a trained adapter: B off its zero init, so a load that kept a fresh init shows
        for p in module.policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    module.to(torch.bfloat16)  # what a bf16-true run's module is when it saves
    state = module.state_dict()
    adapter = {k: v for k, v in state.items() if k != LORA_FINGERPRINT_KEY}
    assert adapter and all(v.dtype == torch.bfloat16 for v in adapter.values())
    fresh = RLPolicyModule("tiny", lora=LORA)
    fresh.load_state_dict(state)
    loaded = fresh.state_dict()
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], v.float()) for k, v in adapter.items())  # into the fresh float32 module
    cast = RLPolicyModule("tiny", lora=LORA)
    cast.to(torch.bfloat16)  # and the other order: restored after the cast
    cast.load_state_dict(state)
    loaded = cast.state_dict()
    assert all(loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], v) for k, v in adapter.items())

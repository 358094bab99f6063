"""``lightning-fasync export`` of a LoRA run's checkpoint: the merged model as a plain Hugging Face
directory (``transformers`` loads it) and the adapter in peft's format (``peft.PeftModel.from_pretrained``
loads it onto the base): both give the trained policy's logits."""

import pytest
import torch

from lightning_fasync.config import ConfigError
from lightning_fasync.export.hf import export_checkpoint, main
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.policy import build_policy

IDS = torch.tensor([[1, 40, 41, 42, 43, 44]])


@pytest.fixture(scope="module")
def trained_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    module = RLPolicyModule("tiny", lora={"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]})
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    module.policy.eval()
    with torch.no_grad():
        logits = module.policy(input_ids=IDS).logits
    path = tmp_path_factory.mktemp("ckpt") / "last.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return str(path), logits


def test_the_merged_export_loads_in_transformers_with_the_trained_logits(trained_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt, logits = trained_ckpt
    out = export_checkpoint(ckpt, str(tmp_path / "merged"))
    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True).eval()
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    torch.testing.assert_close(got, logits, rtol=0, atol=1e-5)


def test_the_adapter_export_loads_with_peft_onto_the_base(trained_ckpt, tmp_path):
    from peft import PeftModel

    ckpt, logits = trained_ckpt
    assert main(["--ckpt_path", ckpt, "--out", str(tmp_path / "adapter"), "--lora", "adapter"]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    base, _ = build_policy("tiny")
    model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    torch.testing.assert_close(got, logits, rtol=0, atol=1e-6)


def test_the_adapter_flag_on_a_full_fine_tuning_checkpoint_is_refused(tmp_path):
    module = RLPolicyModule("tiny")
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    with pytest.raises(ConfigError, match="`--lora` is adapter, but the checkpoint .* holds no LoRA adapter"):
        export_checkpoint(str(path), str(tmp_path / "out"), lora="adapter")


def test_another_base_is_refused(trained_ckpt, tmp_path):
    ckpt, _ = trained_ckpt
    with pytest.raises(ConfigError, match="fingerprints differ|does not fit"):
        export_checkpoint(ckpt, str(tmp_path / "out"), model="tiny-hd32")

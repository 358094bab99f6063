"""`lightning-fasync export`: a checkpoint's policy as a Hugging Face directory.

The end-to-end case (a real `fit` checkpoint, loaded back with `transformers`) is in
tests/test_fit.py::test_embedded_default_learns_end_to_end; these check the command's contract on a
checkpoint-shaped file."""

import os

import pytest
import torch

from lightning_fasync.cli import main
from lightning_fasync.policy import build_policy


def _checkpoint(path, model="tiny", prefix="policy.", drop=None):
    torch.manual_seed(0)
    policy, _ = build_policy(model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the preset's weights
    state = {prefix + k: v for k, v in policy.state_dict().items() if k != drop}
    torch.save({"state_dict": state, "hyper_parameters": {"model": model}, "epoch": 0}, path)
    return policy


def test_export_writes_a_directory_transformers_loads_with_the_checkpoints_weights(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    policy = _checkpoint(tmp_path / "a.ckpt")
    out = tmp_path / "hf"
    assert main(["export", "--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(out)]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (k, a), (k2, b) in zip(sorted(policy.state_dict().items()), sorted(loaded.state_dict().items())):
        assert k == k2 and torch.equal(a, b), k
    again, tok = build_policy(str(out))  # what `lightning-fasync serve --model DIR` loads
    ids = torch.tensor([tok("<s>g*3=")["input_ids"]])
    assert torch.allclose(again(ids).logits, policy(ids).logits, atol=1e-6)


def test_export_refuses_what_it_cannot_do_in_one_sentence(tmp_path, capsys):
    _checkpoint(tmp_path / "a.ckpt")
    _checkpoint(tmp_path / "short.ckpt", drop="lm_head.weight")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["--ckpt_path", str(tmp_path / "none.ckpt"), "--out", str(tmp_path / "o1")], "is not a file"),
        (["--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "full")], "exists and is not empty"),
        (["--ckpt_path", str(tmp_path / "short.ckpt"), "--out", str(tmp_path / "o2")], "1 of the model's tensors are missing (lm_head.weight)"),
        (["--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "o3"), "--prefix", "model."], "missing"),
    ]
    for args, words in cases:
        assert main(["export", *args]) == 2, args
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (args, err)
    assert main(["export", "--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "full"), "--overwrite"]) == 0

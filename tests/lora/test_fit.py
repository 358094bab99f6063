"""End to end: the main job (``configs/tiny_cpu.yaml``) with ``model.lora`` and the adapter path
(``rollout.weight_sync: adapter``), through the real CLI and a real engine process: the reward rises
with adapters alone, the checkpoints hold only the adapter, and the run's last checkpoint exports
as an adapter that peft loads and as a merged model, with the same logits, and the run resumes from
it."""

import glob
import os
import subprocess
import sys
import warnings

import pytest
import torch

from tests.helpers.paths import REPO

TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")
# The embedded default with LoRA on every linear layer, lm_head included (tiny's is not tied): a
# 3-layer random model learns the task through its adapters only with lm_head's, at 3x the full
# fine-tuning rate (LoRA's usual larger learning rate; at 5x, 1 run in 16 collapsed, below).
LORA_ARGS = ["--model.lora.r=16", "--model.lora.alpha=32", "--model.lr=0.003",
             "--model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
             "--model.lora.sync=adapter", "--rollout.weight_sync=adapter",
             # Every push checked: the engine serves the base with this adapter merged (its log-probs of a probe).
             "--rollout.check_weights=true"]


SERIES = ["rollout/reward_mean", "rollout/response_length_mean", "train/entropy", "train/grad_norm",
          "train/version_lag_mean", "rollout/engine_restarts"]


def fit(root, seed, steps):
    """The main job with LoRA_ARGS for ``steps`` rollout steps: its command, log directory, scalars and output."""
    from lightning_fasync.plots import read_scalars

    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", TINY, f"--trainer.default_root_dir={root}",
           "--trainer.enable_progress_bar=false", f"--trainer.rollout_steps={steps}", "--trainer.save_freq=30",
           f"--seed_everything={seed}", *LORA_ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "weight sync `adapter`" in proc.stderr
    (log_dir,) = glob.glob(os.path.join(root, "lightning_logs", "version_*"))
    scalars = read_scalars(log_dir)
    assert len(scalars["rollout/reward_mean"]) == steps
    return cmd, log_dir, scalars, proc


def gain(scalars):
    """The last 5 steps' mean reward less the first 5 steps'."""
    rewards = [v for _, v in scalars["rollout/reward_mean"]]
    return sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5


def describe(seed, scalars, proc):
    """A run's per-step series and its output's tail, for a message."""
    lines = [f"seed {seed}: reward gain {gain(scalars):.3f}"]
    lines += [f"  {k}: " + " ".join(f"{v:.3g}" for _, v in scalars.get(k, [])) for k in SERIES]
    return "\n".join(lines + ["  output tail:", proc.stderr[-1500:]])


@pytest.mark.slow
def test_the_main_job_learns_with_lora_adapters_over_the_adapter_path(tmp_path):
    # 60 rollout steps: the untrained policy's 5-step mean reward is ~0.002. At lr 0.005 it rose by
    # 0.02-0.33 over 16 runs (seeds 7 and 1-4; alone, two at once, and two at once pinned to one core
    # each, as the slow pass's workers are) and by 0.005 in one CI run: that run and one of the 16
    # collapsed (response lengths fell to one token, then stuck at the 65-token budget with entropy
    # 0.08, every group's answers alike: no advantage left to learn from). At lr 0.003, 12 runs
    # pinned in pairs (seeds 1-11) rose by 0.26-0.42 (median 0.32), entropy never under 0.5, so
    # 0.08 fails without learning. A run that still does not learn is reported (its per-step
    # series) and one more seed runs; both must fail to fail.
    steps = 60
    seeds = (7, 1)
    reports = []
    for seed in seeds:
        cmd, log_dir, scalars, proc = fit(tmp_path / f"seed{seed}", seed, steps)
        if gain(scalars) >= 0.08:
            break
        reports.append(describe(seed, scalars, proc))
        warnings.warn("the LoRA run did not learn:\n" + reports[-1])
    assert len(reports) < len(seeds), "\n".join(reports)
    # Every step's metrics name the last checked push's largest probe gap: each push was checked.
    gaps = [v for _, v in scalars["weights/check_gap"]]
    assert len(gaps) == steps and max(gaps) < 1e-3, gaps

    last_ckpt = os.path.join(log_dir, "checkpoints", "last.ckpt")
    ckpt = torch.load(last_ckpt, weights_only=True, map_location="cpu")
    policy_keys = [k for k in ckpt["state_dict"] if k.startswith("policy.")]
    assert policy_keys and all(".lora_A." in k or ".lora_B." in k for k in policy_keys)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_fasync.export.hf import export_checkpoint
    from lightning_fasync.lightning.module import RLPolicyModule
    from lightning_fasync.policy import build_policy

    restored = RLPolicyModule("tiny", lora=ckpt["hyper_parameters"]["lora"])
    restored.on_load_checkpoint(ckpt)
    restored.load_state_dict(ckpt["state_dict"])
    ids = torch.tensor([[1, 75, 11, 17, 17, 29]])
    with torch.no_grad():
        expected = restored.policy.eval()(input_ids=ids).logits
        adapter = PeftModel.from_pretrained(build_policy("tiny")[0],
                                            export_checkpoint(last_ckpt, str(tmp_path / "adapter"), lora="adapter")).eval()
        merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(last_ckpt, str(tmp_path / "merged"))).eval()
        torch.testing.assert_close(adapter(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-4)

    # The run resumes from its adapter-only checkpoint through Lightning (base rebuilt, fingerprint checked).
    resume = [*cmd[:-len(LORA_ARGS)], *LORA_ARGS, f"--trainer.rollout_steps={steps + 2}", "--ckpt_path", "last"]
    proc = subprocess.run(resume, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    assert f"Trained {steps + 2} rollout steps" in proc.stdout + proc.stderr

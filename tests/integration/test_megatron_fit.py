"""``lightning-fasync fit`` with ``MegatronStrategy`` end to end, on 2 CPU processes (gloo).

The same ``FullyAsyncCallback``, step protocol, checkpoints and metrics as every other trainer:
a Qwen3-shaped policy trains a step with pipeline parallelism (PP=2: rank 0 holds the embedding
and the first layer, rank 1 the second layer and the output; two micro-batches per call) against
the embedded engine, pushing weights gathered from the stages, and writes a megatron-core
``dist_checkpointing`` checkpoint and a ``trainer.save_hf`` directory. A second run resumes the
checkpoint for a second step with tensor parallelism instead (TP=2: another layout), and the ledger shows every
prompt trained exactly once. ``lightning-fasync export`` of the checkpoint equals the trainer's own
gathered ``save_hf`` directory. Each rank runs under ``tests/helpers/megatron_cpu.py``'s
``cpu_training_shim`` (``tests/helpers/megatron_fit.py``); the engines run without it.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.megatron_cpu import require_megatron

require_megatron()

from lightning_fasync.cli import main  # noqa: E402
from lightning_fasync.pipeline.events import read_jsonl  # noqa: E402
from lightning_fasync.plots import read_scalars  # noqa: E402
from tests.helpers.ledger_audit import audit_resume  # noqa: E402
from tests.helpers.paths import HELPERS, REPO  # noqa: E402

TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")
FIT = os.path.join(HELPERS, "megatron_fit.py")
B, N, M = 4, 4, 8  # prompts per step, trajectories per prompt, mini-batch: 2 training calls per step


def save_policy(path) -> None:
    """A 2-layer Qwen3 (tied embeddings, q/k norms, 4 heads on 2 kv heads) with the char tokenizer;
    the vocabulary is rounded up to 128 so TP=2 splits it evenly."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from lightning_fasync.policy import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True, rms_norm_eps=1e-6, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         initializer_range=0.1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)


def fit(tmp_path, model_dir, layout: list[str], steps: int, extra: list[str], name: str) -> None:
    cmd = [sys.executable, FIT, "fit", "--config", TINY, f"--model.model={model_dir}", "--model.micro_batch_size=2",
           "--model.lr_schedule=constant", f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
           f"--trainer.rollout_steps={steps}", "--trainer.save_hf=true",
           f"--data_source.num_prompts_per_step={B}", f"--data_source.num_trajectories_per_prompt={N}",
           f"--trainer.mini_batch_size={M}", "--rollout.max_response_length=24",
           # A random policy scores 0 on every prompt (no advantage): the entropy bonus gives every
           # call a gradient.
           "--algorithm.entropy_coef=0.01",
           # Lightning's clipping is automatic optimisation's; megatron-core's optimizer clips.
           "--trainer.gradient_clip_val=null", "--model.grad_clip=1.0",
           "--trainer.strategy=MegatronStrategy", "--trainer.devices=2", "--trainer.accelerator=cpu", *layout, *extra]
    with open(tmp_path / f"{name}.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=600, start_new_session=True)
    assert done.returncode == 0, (tmp_path / f"{name}.log").read_text()[-5000:]


@pytest.mark.slow
def test_pipeline_parallel_run_then_tensor_parallel_resume_trains_every_prompt_once(tmp_path):
    model_dir = tmp_path / "policy"
    save_policy(model_dir)
    fit(tmp_path, model_dir, ["--trainer.strategy.pipeline_model_parallel_size=2"], 1, ["--trainer.save_freq=1"], "pp2")
    # (No checkpoint in the resumed run: megatron-core's writer starts a process of its own at a
    # run's first save, and the PP=2 checkpoint is exported below.)
    fit(tmp_path, model_dir, ["--trainer.strategy.tensor_model_parallel_size=2"], 2,
        ["--ckpt_path", "last", "--trainer.save_freq=0"], "tp2")

    run1, run2 = (os.path.join(tmp_path, "lightning_logs", f"version_{i}") for i in (0, 1))
    audit_resume(read_jsonl(os.path.join(run1, "ledger.jsonl")), read_jsonl(os.path.join(run2, "ledger.jsonl")), B, 2)
    consumed = [r for r in read_jsonl(os.path.join(run2, "ledger.jsonl")) if r["kind"] == "consume"]
    assert max(r["end_version"] for r in consumed) >= 1  # the engines served weights pushed from the shards
    for run in (run1, run2):
        tb = read_scalars(run)
        assert tb["train/loss"] and all(math.isfinite(v) for _, v in tb["train/loss"])
        assert all(math.isfinite(v) and v > 0 for _, v in tb["train/grad_norm"])
        assert tb["train/entropy"] and tb["timing/update_weights"]

    # The checkpoint (PP=2 shards) exported on one process equals what the trainer gathered into its
    # save_hf directory at that step, and differs from the initial weights.
    from transformers import AutoModelForCausalLM

    last = os.path.join(run1, "checkpoints", "last.ckpt")
    out = tmp_path / "exported"
    assert main(["export", "--ckpt_path", last, "--out", str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    gathered = AutoModelForCausalLM.from_pretrained(
        os.path.join(run1, "checkpoints", os.path.basename(os.path.realpath(last)).replace(".ckpt", ".hf"))).eval()
    initial = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    assert list(exported.state_dict()) == list(gathered.state_dict())
    for (name, a), (_, b) in zip(exported.state_dict().items(), gathered.state_dict().items()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(exported.state_dict().values(), initial.state_dict().values()))

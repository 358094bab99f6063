"""Sharded training end to end: Lightning's ModelParallelStrategy on 2 CPU processes (gloo).

One run trains the embedded default with FSDP2 (``data_parallel_size=2``), writing distributed
checkpoints and ``trainer.save_hf`` directories, and is SIGKILLed mid-run; its resume from
``--ckpt_path last`` trains with tensor parallelism instead (``tensor_parallel_size=2``: the same
checkpoint loaded into another layout) over the ``distributed`` weight sync. The ledger audit shows
every prompt trained exactly once; ``lightning-fasync export`` of the last distributed checkpoint
gives the weights the trainer gathered into its ``save_hf`` directory, and transformers loads both.
"""

import glob
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from lightning_fasync.cli import main
from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.plots import read_scalars
from lightning_fasync.policy import build_policy
from tests.helpers.ledger_audit import audit_resume, children_of
from tests.helpers.paths import REPO

TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")
B, STEPS, KILL_AFTER = 16, 3, 1  # checkpoints after every step; the kill lands in step 1 or later


def _strategy(dp: int, tp: int) -> list[str]:
    return ["--trainer.strategy=ModelParallelStrategy", f"--trainer.strategy.data_parallel_size={dp}",
            f"--trainer.strategy.tensor_parallel_size={tp}", "--trainer.devices=2", "--trainer.accelerator=cpu"]


@pytest.mark.slow
def test_fsdp2_run_killed_then_resumed_with_tensor_parallel_trains_every_prompt_once(tmp_path):
    base = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", TINY,
            f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
            f"--trainer.rollout_steps={STEPS}", "--trainer.save_freq=1", "--trainer.save_hf=true"]
    log1 = tmp_path / "run1.log"
    with open(log1, "w") as log:
        # A session of its own: rank 1 is rank 0's child, and the kill takes both, as a scheduler would.
        proc = subprocess.Popen(base + _strategy(2, 1), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
    ledger1 = os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl")
    deadline = time.monotonic() + 420
    try:
        while True:
            assert proc.poll() is None, log1.read_text()[-4000:]
            assert time.monotonic() < deadline, "the FSDP2 run never reached step " + str(KILL_AFTER)
            if os.path.exists(ledger1) and any(r["kind"] == "consume" and r["step"] >= KILL_AFTER
                                               for r in read_jsonl(ledger1)):
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    t0 = time.monotonic()
    while children_of(proc.pid) and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    assert children_of(proc.pid) == [], "engine processes outlived the killed trainer"

    run1_dir = os.path.join(tmp_path, "lightning_logs", "version_0")
    ckpts = os.path.join(run1_dir, "checkpoints")
    saved = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ckpts, "step-*.ckpt")))
    assert saved, log1.read_text()[-3000:]
    # Distributed checkpoints: a directory per step, each rank's part in it, and meta.pt once.
    for name in saved:
        assert os.path.isfile(os.path.join(ckpts, name, "meta.pt"))
        assert os.path.isfile(os.path.join(ckpts, name, ".metadata"))
    # Each save_hf directory follows its checkpoint (the kill may land between the newest two).
    with_hf = [n for n in saved if os.path.isdir(os.path.join(ckpts, n.replace(".ckpt", ".hf")))]
    assert with_hf and set(saved) - set(with_hf) <= {saved[-1]}

    # The resume: the same checkpoint into tensor parallel (TP=2), weights over the distributed path.
    resumed = subprocess.run(base + _strategy(1, 2) + ["--rollout.weight_sync=distributed", "--ckpt_path", "last"],
                             capture_output=True, text=True, timeout=600, cwd=REPO, start_new_session=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    run2_dir = os.path.join(tmp_path, "lightning_logs", "version_1")
    audit_resume(read_jsonl(ledger1), read_jsonl(os.path.join(run2_dir, "ledger.jsonl")), B, STEPS)
    consumed = [r for r in read_jsonl(os.path.join(run2_dir, "ledger.jsonl")) if r["kind"] == "consume"]
    assert max(r["end_version"] for r in consumed) >= 1  # the engines served weights pushed from TP shards
    tb = read_scalars(run2_dir)
    assert tb["train/loss"] and all(math.isfinite(v) for _, v in tb["train/loss"])
    assert all(math.isfinite(v) and v > 0 for _, v in tb["train/grad_norm"])

    # Export the last distributed checkpoint of each layout (FSDP2 shards, TP shards): each holds
    # the weights the trainer gathered into its save_hf directory at that step. (With TP, both
    # ranks hold the norms and embeddings whole and the checkpoint keeps one rank's copy: equal
    # only if the ranks never drifted apart.)
    from transformers import AutoModelForCausalLM

    untrained, _ = build_policy("tiny")
    for run_dir, last in ((run1_dir, os.path.join(ckpts, with_hf[-1])),
                          (run2_dir, os.path.join(run2_dir, "checkpoints", "last.ckpt"))):
        step_name = os.path.basename(os.path.realpath(last))
        out = tmp_path / f"exported-{os.path.basename(run_dir)}"
        assert main(["export", "--ckpt_path", last, "--out", str(out)]) == 0  # lightning-fasync export
        exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        gathered = AutoModelForCausalLM.from_pretrained(
            os.path.join(run_dir, "checkpoints", step_name.replace(".ckpt", ".hf"))).eval()
        assert list(exported.state_dict()) == list(gathered.state_dict())
        for (name, a), (_, b) in zip(exported.state_dict().items(), gathered.state_dict().items()):
            assert torch.equal(a, b), (run_dir, name)
        assert any(not torch.equal(a, b) for a, b in zip(exported.state_dict().values(),
                                                         untrained.state_dict().values()))  # it trained
        ids = torch.randint(3, exported.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(exported(ids).logits, gathered(ids).logits)

"""Data-parallel ranks (2 CPU processes, gloo) with packed, token-budget micro-batches: shares balanced
by tokens, the ranks agreeing on a micro-batch count, the single-process update, and (the main job
under DDP) every prompt trained exactly once."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest

from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.plots import read_scalars
from tests.helpers.paths import REPO
from tests.trainer_packing.ranks_driver import DRIVERS

TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")


def _failure(proc) -> str:
    """The run's output tail, after every line that names an error (a rank's own crash comes
    first, before the other ranks' connection errors fill the tail)."""
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line][:40]
    return "\n".join(errors) + "\n--- tail ---\n" + proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def drivers_run(tmp_path_factory):
    """The four drivers in turn in one pair of rank processes (torch.distributed.run's), each into
    its own directory: one launch and one set of imports instead of four."""
    out = tmp_path_factory.mktemp("ranks")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "tests.trainer_packing.ranks_driver", str(out), ",".join(DRIVERS)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    return out, proc


@pytest.mark.slow
@pytest.mark.parametrize("driver", DRIVERS)
def test_micro_batched_ranks_give_the_single_process_update(drivers_run, driver):
    out, proc = drivers_run
    assert proc.returncode == 0, _failure(proc)
    ranks = [json.load(open(out / driver / f"rank{r}.json")) for r in (0, 1)]
    assert all(rank["sharded"] == driver.endswith("fsdp2") for rank in ranks)
    # Whole groups, the same number each, disjoint and covering every call's groups.
    for call in range(len(ranks[0]["shares"])):
        a, b = ranks[0]["shares"][call], ranks[1]["shares"][call]
        assert len(a) == len(b) and not set(a) & set(b) and len(set(a + b)) == 4
    # The token budget cut the ranks' shares into different numbers of micro-batches at least once;
    # they ran the larger number, the same on both.
    assert ranks[0]["planned"] != ranks[1]["planned"]
    assert ranks[0]["ran"] == ranks[1]["ran"] == [max(p) for p in zip(ranks[0]["planned"], ranks[1]["planned"])]
    # Every rank's update is the one process's on the whole padded calls (which moved the weights).
    assert ranks[0]["moved"] > 1e-3
    assert ranks[0]["max_param_gap"] <= 1e-6, ranks[0]["max_param_gap"]


@pytest.mark.slow
def test_ddp_fit_with_packed_micro_batches_trains_every_prompt_once(tmp_path):
    """The main job under DDP with the token budget: shares by tokens, micro-batched calls; the
    ledger audit of tests/lightning/test_ddp.py."""
    steps = 3
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
           "--trainer.enable_progress_bar=false", "--trainer.strategy=ddp", "--trainer.devices=2",
           "--trainer.accelerator=cpu", f"--trainer.rollout_steps={steps}", "--trainer.save_freq=0",
           "--trainer.pack_sequences=true", "--trainer.max_tokens_per_micro_batch=96"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, _failure(proc)
    (log_dir,) = glob.glob(os.path.join(tmp_path, "lightning_logs", "version_*"))
    consumed = [r for r in read_jsonl(os.path.join(log_dir, "ledger.jsonl")) if r["kind"] == "consume"]
    assert len(consumed) == steps * 16 and len({r["prompt"] for r in consumed}) == steps * 16
    tb = read_scalars(log_dir)
    assert [s for s, _ in tb["train/loss"]] == list(range(steps))
    assert all(math.isfinite(v) and v > 0 for _, v in tb["train/grad_norm"])

"""FullyAsyncFabricLoop on several processes: 2 CPU processes on gloo, only global rank 0 runs the
rollout side, every rank trains on its share (tests/helpers/fabric_ranks_driver.py runs the script)."""

import json
import math
import os
import subprocess
import sys

import pytest

from lightning_fasync.config import ConfigError, load_config, validate
from lightning_fasync.runtime.ranks import check_minibatch_share, data_parallel, dp_share
from lightning_fasync.pipeline.events import read_jsonl
from tests.helpers.ledger_audit import audit_resume, children_of
from tests.helpers.paths import HELPERS, REPO

DRIVER = os.path.join(HELPERS, "fabric_ranks_driver.py")
B, STEPS = 4, 3


@pytest.mark.slow
# FSDP2 only: the follower protocol is the same for DDP (tests/lightning/test_ddp.py runs DDP under the
# callback) and tensor parallel (tests/integration/test_sharded_fit.py); the driver also takes "ddp" and "tp2".
@pytest.mark.parametrize("strategy", ["fsdp2"])
def test_fabric_loop_on_two_processes(tmp_path, strategy):
    """DDP, and ModelParallelStrategy with the policy sharded by shard_policy: FSDP2 over 2
    data-parallel ranks, or tensor parallel over 2 ranks that form one data-parallel rank (the
    weight sync gathers a TensorStream on both ranks; checkpoints are distributed, each rank
    writing its part)."""
    proc = subprocess.Popen([sys.executable, DRIVER, str(tmp_path), strategy], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert children_of(proc.pid) == []  # rank 0 stopped its engines, each run
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]

    # Run 1: one ledger (rank 0's pipeline), every prompt trained exactly once, B per step.
    run1 = read_jsonl(str(tmp_path / "run1" / "ledger.jsonl"))
    consumed = [r for r in run1 if r["kind"] == "consume"]
    assert len(consumed) == STEPS * B == len({r["prompt"] for r in consumed})
    # Each training call's groups were split between the data-parallel ranks (disjoint shares
    # covering them all); tensor-parallel peers trained the same groups.
    shares = [sum(rank["run1"]["shares"], []) for rank in ranks]
    if strategy == "tp2":
        assert shares[0] == shares[1] and sorted(shares[0]) == sorted(r["prompt"] for r in consumed)
    else:
        assert all(len(s) == STEPS * B // 2 for s in shares) and not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == sorted(r["prompt"] for r in consumed)
    # The engines served the weights pushed at each boundary.
    assert max(r["end_version"] for r in consumed) >= 1 and ranks[0]["run1_versions"] == STEPS
    # ranks.reduce_metrics: by the naming rule (mean, timing/* summed, *_max, *_min), the same everywhere.
    assert ranks[0]["reduced"] == ranks[1]["reduced"] == {
        "train/loss": 1.5, "timing/train": 4.0, "train/is_max": 3.0, "train/lag_min": -1.0}
    # Each call's metrics were reduced over the data-parallel ranks before anyone saw them (perf/*
    # is each process's own memory, which tensor-parallel peers do not reduce with each other).
    calls = [[{k: v for k, v in call.items() if not k.startswith("perf/")} for call in rank["run1"]["calls"]]
             for rank in ranks]
    assert calls[0] == calls[1] and len(calls[0]) == 2 * STEPS
    # Every rank was told the step's metrics; the loss is finite, gradients flowed.
    for rank in ranks:
        assert [m["step"] for m in rank["run1"]["steps"]] == list(range(STEPS))
        assert all(math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 for m in rank["run1"]["steps"])
    assert ranks[0]["run1"]["steps"] == ranks[1]["run1"]["steps"]
    # Gradients were averaged: the ranks' weights moved, and stayed equal, step after step.
    assert ranks[0]["run1"]["weights"] == ranks[1]["run1"]["weights"]
    assert ranks[0]["run1"]["weights"][-1] != ranks[0]["initial"]
    assert sorted(os.listdir(tmp_path / "run1" / "checkpoints")) == ["last.ckpt", "step-000001.ckpt"]

    # Run 2 resumed from step 1's checkpoint; SIGTERM to rank 1 alone ended it after step 2's
    # boundary saved, with 143 on both ranks; nothing trained twice, nothing lost.
    run2 = read_jsonl(str(tmp_path / "run2" / "ledger.jsonl"))
    assert [rank["restored"] for rank in ranks] == [ranks[0]["run1"]["weights"][1]] * 2  # fabric.load, every rank
    assert audit_resume(run1, run2, B, STEPS) == 2
    assert [rank["run2_exit"] for rank in ranks] == [143, 143]
    assert [m["step"] for m in ranks[1]["run2"]["steps"]] == [2]
    assert [r["step"] for r in run2 if r["kind"] == "checkpoint"] == [2]
    assert os.path.realpath(tmp_path / "run2" / "checkpoints" / "last.ckpt").endswith("step-000002.ckpt")
    assert "Interrupted by SIGTERM: saved the checkpoint" in out

    # Run 3: rank 0 refused the state before starting anything; rank 1 was told and stopped too.
    assert ranks[0]["run3_error"].startswith("ConfigError: ")
    assert ranks[1]["run3_error"].startswith("PipelineError: Global rank 0 stopped the run (ConfigError: ")


# ------------------------------------------------------------------------------ lightning_fasync/runtime/ranks.py


def test_data_parallel_reads_ddp_and_model_parallel_strategies():
    from types import SimpleNamespace

    ddp = SimpleNamespace(global_rank=1, world_size=2, distributed_sampler_kwargs={"rank": 1, "num_replicas": 2})
    assert data_parallel(ddp) == (1, 2, None)  # the global group
    group = object()
    mesh = {"data_parallel": SimpleNamespace(get_group=lambda: group)}
    tp = SimpleNamespace(global_rank=1, world_size=2, device_mesh=mesh,
                         distributed_sampler_kwargs={"rank": 0, "num_replicas": 1})
    assert data_parallel(tp) == (0, 1, group)  # tensor-parallel peers: one data-parallel rank


def test_a_minibatch_the_data_parallel_ranks_cannot_share_is_refused():
    cfg = validate(load_config({"colocate": False, "fully_async": {"enable": True},
                                "data_source": {"num_prompts_per_step": 6, "num_trajectories_per_prompt": 2},
                                "trainer": {"mini_batch_size": 6}}))
    check_minibatch_share(cfg, 3)
    with pytest.raises(ConfigError, match=r"`trainer.mini_batch_size` is 6: each training call has M // N = 3 groups"):
        check_minibatch_share(cfg, 2)
    assert dp_share(list("abcdef"), 1, 3) == ["b", "e"]

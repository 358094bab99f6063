"""Data-parallel trainer: DDP on 2 CPU processes (gloo); only global rank 0 runs the rollout side."""

import glob
import math
import os
import subprocess
import sys

import pytest

from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.plots import read_scalars
from tests.helpers.paths import REPO

TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")


@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path):
    steps = 3
    # The distributed weight sync (docs/weight_sync.md): rank 0 of the DDP job, which has its own
    # default process group, forms the weight-update group with the engine and broadcasts on gloo.
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
           "--trainer.enable_progress_bar=false", "--trainer.strategy=ddp", "--trainer.devices=2",
           "--trainer.accelerator=cpu", f"--trainer.rollout_steps={steps}", "--trainer.save_freq=2",
           "--rollout.weight_sync=distributed"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (log_dir,) = glob.glob(os.path.join(tmp_path, "lightning_logs", "version_*"))
    # One producer: every dispatch sequence number appears once in the (single) event log.
    dispatch = [e["seq"] for e in read_jsonl(os.path.join(log_dir, "events.jsonl")) if e["event"] == "dispatch"]
    assert dispatch and len(dispatch) == len(set(dispatch))
    consumed = [r for r in read_jsonl(os.path.join(log_dir, "ledger.jsonl")) if r["kind"] == "consume"]
    assert len(consumed) == steps * 16 and len({r["prompt"] for r in consumed}) == steps * 16
    # The engines served the pushed weights under the versions the pushes gave them.
    assert all(r["end_version"] <= r["step"] for r in consumed) and max(r["end_version"] for r in consumed) >= 1
    tb = read_scalars(log_dir)
    # Reduced on the main thread, logged once per rollout step by rank 0.
    assert [s for s, _ in tb["train/loss"]] == list(range(steps))
    assert all(math.isfinite(v) for _, v in tb["train/grad_norm"])
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(log_dir, "checkpoints", "*.ckpt"))) == [
        "last.ckpt", "step-000001.ckpt"]


def test_a_minibatch_the_data_parallel_ranks_cannot_share_is_refused_at_setup(tmp_path):
    """M // N = 2 groups per call: 3 data-parallel ranks cannot share them (refused before anything
    starts); 2 tensor-parallel ranks that form one data-parallel rank can."""
    from types import SimpleNamespace

    import torch

    from lightning_fasync.config import ConfigError
    from lightning_fasync.lightning import RLPolicyModule
    from lightning_fasync.lightning.callback import FullyAsyncCallback

    config = {"colocate": False, "fully_async": {"enable": True},
              "data_source": {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2},
              "trainer": {"mini_batch_size": 4}}

    def trainer(dp: int, world: int, rank: int):
        # A meta root device: no core pinning of this test process on the rank that is not 0.
        strategy = SimpleNamespace(distributed_sampler_kwargs={"rank": 0, "num_replicas": dp}, global_rank=rank,
                                   world_size=world, num_processes=world, root_device=torch.device("meta"))
        return SimpleNamespace(strategy=strategy, global_rank=rank, world_size=world, local_rank=rank,
                               log_dir=str(tmp_path), default_root_dir=str(tmp_path))

    cb = FullyAsyncCallback(config)
    module = RLPolicyModule(**RLPolicyModule.algorithm_args(cb.cfg))
    with pytest.raises(ConfigError, match="2 groups, which 3 data-parallel ranks cannot share evenly"):
        cb.setup(trainer(3, 3, 0), module, "fit")
    assert cb.runtime is None
    tp = FullyAsyncCallback(config)
    tp.setup(trainer(1, 2, 1), module, "fit")  # rank 1 of one data-parallel rank: accepted, starts nothing
    assert (tp._dp_rank, tp._dp_size) == (0, 1) and tp.runtime is None


def test_strategies_the_weight_sync_cannot_gather_from_are_refused_with_a_clear_error():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_fasync.config import ConfigError
    from lightning_fasync.lightning.callback import FullyAsyncCallback

    cb = FullyAsyncCallback({"colocate": False, "fully_async": {"enable": True},
                             "data_source": {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2},
                             "trainer": {"mini_batch_size": 4}})
    trainer = SimpleNamespace(strategy=FSDPStrategy())
    # The legacy FSDP (flat parameters) cannot be gathered from; the message names what can.
    with pytest.raises(ConfigError, match="`trainer.strategy` is FSDPStrategy.*use ModelParallelStrategy"):
        cb.setup(trainer, SimpleNamespace(), "fit")
    assert cb.runtime is None  # nothing started


def test_model_parallel_is_a_strategy_name():
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy

    import lightning_fasync.lightning  # noqa: F401 - registers the name

    trainer = Trainer(strategy="model_parallel", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(trainer.strategy, ModelParallelStrategy)

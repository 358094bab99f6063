"""The no-staleness setting is synchronous training (docs/overview.md, "Staleness bounded in versions").

``fully_async.sliding_window: staleness-bounded`` at ``stale_steps: 0`` lets the engines generate a
step's B groups under that step's weights and no more, and hands them to the trainer in dispatch
order. With seeded sampling (``rollout.sampling_seed``) and engines whose numbers do not depend on
batching (``rollout.deterministic_inference``), a fully-async run then trains bit-identically to
colocate from the same seed: the same groups in the same calls, every metric and every final weight
equal. Both runs get the same single core, so the trainer and the engine run with the same thread
counts in both modes (torch's reductions are not bit-stable across thread counts).

The negative control is the spec's own stale-0 setting (``windowed-fifo``): there a group the trainer
takes frees capacity at once, so groups dispatched under one step's weights are trained in the next.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from lightning_fasync.plots import read_scalars
from tests.helpers.ledger_audit import run_fit
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow

STEPS = 4
COMMON = [
    "--trainer.rollout_steps", str(STEPS), "--trainer.save_freq", str(STEPS), "--trainer.enable_progress_bar=false",
    # B x N = 32 trajectories a step in 2 training calls of M = 16: the calls' groups must match too.
    "--data_source.num_prompts_per_step=8", "--data_source.num_trajectories_per_prompt=4",
    "--trainer.mini_batch_size=16", "--rollout.sampling_seed=11", "--rollout.deterministic_inference=true",
]
MODES = {
    "colocate": ["--colocate=true", "--fully_async.enable=false"],
    "synchronous": ["--fully_async.sliding_window=staleness-bounded", "--fully_async.stale_steps=0"],
    "spec-stale-0": ["--fully_async.sliding_window=windowed-fifo", "--fully_async.stale_steps=0"],
}


def _one_core():
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, flags in MODES.items():
        root = str(tmp_path_factory.mktemp(name))
        cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", "configs/tiny_cpu.yaml",
               "--trainer.default_root_dir", root, *COMMON, *flags]
        _, log_dir = run_fit(cmd, root, REPO, timeout=600, preexec_fn=_one_core)
        ledger = [json.loads(line) for line in open(os.path.join(log_dir, "ledger.jsonl"))]
        weights = torch.load(os.path.join(log_dir, "checkpoints", "last.ckpt"), weights_only=True)["state_dict"]
        out[name] = (ledger, weights, read_scalars(log_dir))
    return out


def _consumed(ledger):
    return [(r["prompt"], r["seq"], r["step"], r["start_version"], r["end_version"])
            for r in ledger if r["kind"] == "consume"]


def test_staleness_bounded_at_stale_0_trains_bit_identically_to_colocate(runs):
    col_ledger, col_weights, col_scalars = runs["colocate"]
    ledger, weights, scalars = runs["synchronous"]
    consumed = _consumed(ledger)
    assert len(consumed) == STEPS * 8
    # Every group the trainer took was generated wholly by the weights of the step that trained it.
    assert all(start == end == step for _, _, step, start, end in consumed), consumed
    assert consumed == _consumed(col_ledger)  # the same groups, in the same order, in the same steps
    trained = {k: v for k, v in col_scalars.items() if k.startswith(("train/", "rollout/reward"))}
    assert trained and all(scalars.get(k) == v for k, v in trained.items()), \
        [k for k, v in trained.items() if scalars.get(k) != v]
    assert col_weights.keys() == weights.keys()
    assert all(torch.equal(col_weights[k], weights[k]) for k in weights)


def test_the_specs_stale_0_trains_groups_of_older_weights(runs):
    consumed = _consumed(runs["spec-stale-0"][0])
    assert any(start < step for _, _, step, start, _ in consumed), "every group was on-policy: the control shows nothing"

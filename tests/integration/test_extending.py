"""docs/extending.md's example (examples/custom_rollout.py): a datasource, a reward and an agent
flow of one's own, named in the config and built by the runtime's one component loader.

The window-strategy extension has its own example and test:
examples/custom_window.py, tests/integration/test_examples.py::test_custom_window_example_runs.
"""

import asyncio
import glob
import json
import os
import subprocess
import sys

import pytest

from lightning_fasync.config import ConfigError

from lightning_fasync.components import instantiate, load_object
from lightning_fasync.config import validate
from lightning_fasync.fleet.resources import plan_cpu_resources
from lightning_fasync.runtime.rollout_runtime import RolloutRuntime
from lightning_fasync.pipeline.datasource import DataSource
from lightning_fasync.pipeline.engine_client import EngineClient, GenerateResult
from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.plots import read_scalars
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryStatus
from tests.helpers.paths import REPO

EXAMPLES = os.path.join(REPO, "examples")


@pytest.fixture
def example(monkeypatch):
    """examples/custom_rollout.py, importable as ``custom_rollout`` (what the config entries name)."""
    monkeypatch.syspath_prepend(EXAMPLES)
    import custom_rollout

    return custom_rollout


def traj(sample, response, status=TrajectoryStatus.COMPLETED, index=0):
    t = Trajectory(prompt_id=sample.prompt_id, sample_index=index, prompt_ids=list(sample.input_ids))
    t.extend(list(response), [-0.5] * len(response), [0] * len(response))
    t.status = status
    return t


def test_config_entries_build_the_datasource_and_reward(example):
    cfg = validate(example.make_config(rollout_steps=2))
    src = cfg.data_source
    # Exactly what RolloutRuntime does with the entries.
    ds = instantiate(src.datasource, "data_source.datasource", src.datasource_args)
    reward = load_object(src.reward, "data_source.reward")
    assert isinstance(ds, DataSource) and isinstance(ds, example.CountdownPrompts)
    assert reward is example.exact_length_reward
    assert ds.max_prompt_length == 6

    ids = example.char_ids()
    c, eos = ids["c"], ids["eos"]
    # One epoch: 8 prompts, ids 0:0..0:7, one per requested length 8..1, all asking for 'c'.
    epoch0 = [ds.next_sample() for _ in range(8)]
    assert [s.prompt_id for s in epoch0] == [PromptId(0, i) for i in range(8)]
    assert sorted(s.metadata["length"] for s in epoch0) == list(range(1, 9))
    for s in epoch0:
        n = s.metadata["length"]
        assert s.input_ids == [ids["bos"], c, ids["*"], ids[f"{n:02d}"[0]], ids[f"{n:02d}"[1]], ids["="]]
        assert s.metadata["letter"] == "c" and s.metadata["letter_id"] == c
    first = ds.next_sample()
    assert first.prompt_id == PromptId(1, 0)  # the next epoch

    # Recycled prompts come back before new ones, oldest prompt id first, with their tokens.
    partial = traj(epoch0[5], [c, c], status=TrajectoryStatus.CANCELLED)
    s5 = epoch0[5]
    ds.recycle([PromptSample(s5.prompt_id, s5.input_ids, s5.metadata, resume=[partial]), epoch0[2]])
    assert ds.num_recycled == 2
    assert ds.next_sample().prompt_id == PromptId(0, 2)
    back = ds.next_sample()
    assert back.prompt_id == PromptId(0, 5) and back.resume[0].response_ids == [c, c]

    # A checkpoint's round trip (through JSON, as a checkpoint holds plain data) continues exactly.
    ds.recycle([epoch0[7]])
    state = json.loads(json.dumps(ds.state_dict()))
    restored = instantiate(src.datasource, "data_source.datasource", src.datasource_args)
    restored.load_state_dict(state)
    assert [restored.next_sample().to_dict() for _ in range(10)] == [ds.next_sample().to_dict() for _ in range(10)]
    other = instantiate(src.datasource, "data_source.datasource", {"letter": "d"})
    with pytest.raises(ValueError, match="letter"):
        other.load_state_dict(state)

    # The reward: 1.0 only for exactly `length` tokens before EOS; partial credit for the length.
    s3 = next(s for s in epoch0 if s.metadata["length"] == 3)
    assert reward(s3, traj(s3, [c, c, c, eos])) == 1.0
    assert reward(s3, traj(s3, [ids["x"]] * 3 + [eos])) == 1.0  # letters are not checked
    assert reward(s3, traj(s3, [c, eos])) == pytest.approx(0.5 * 1 / 3)
    assert reward(s3, traj(s3, [c] * 6 + [eos])) == pytest.approx(0.5 * 3 / 6)
    assert reward(s3, traj(s3, [c, c, c], status=TrajectoryStatus.TRUNCATED)) == pytest.approx(0.5)  # no EOS
    assert reward(s3, traj(s3, [eos])) == 0.0


class ScriptedEngine(EngineClient):
    """Answers the countdown prompt it reads: the exact answer for trajectory 0, one token too
    many for the others; aborts when told to."""

    def __init__(self, abort=False):
        self.ids = None
        self.abort_all_calls = 0
        self.abort = abort
        self.requests = []

    async def generate(self, request):
        from custom_rollout import char_ids

        ids = char_ids()
        self.requests.append(request)
        digits = {v: k for k, v in ids.items() if k.isdigit()}
        prompt = request.input_ids
        n = int(digits[prompt[3]] + digits[prompt[4]])
        done = len(prompt) - 6
        if self.abort:
            out, reason = [prompt[1]], "abort"
        else:
            want = n if request.rid.endswith("-0") else n + 1
            out, reason = [prompt[1]] * (want - done) + [ids["eos"]], "stop"
        return GenerateResult(request.rid, out, [-0.1] * len(out), [3] * len(out), reason, len(prompt))

    async def abort(self, rid):
        pass

    async def abort_all(self):
        self.abort_all_calls += 1

    async def update_weights_from_tensor(self, named_tensors, weight_version=None):
        self.synced = weight_version


def test_runtime_builds_the_rollout_side_from_the_config(example):
    """RolloutRuntime (what FullyAsyncCallback and FullyAsyncFabricLoop build) with an engine
    client of our own: no engine process starts, the config's entries do the rest."""
    cfg = validate(example.make_config(rollout_steps=2))
    engine = ScriptedEngine()
    # A client that cannot take the trainer's weights is refused before anything starts.
    with pytest.raises(ConfigError, match="has no update_weights_from_disk"):
        RolloutRuntime(cfg, None, plan_cpu_resources(1), log_dir=None, pin=False, client=engine, weight_sync="disk")
    runtime = RolloutRuntime(cfg, None, plan_cpu_resources(1), log_dir=None, pin=False, client=engine)
    runtime.sync_weights({}, 4)
    assert engine.synced == 4
    try:
        ds = runtime.controller.state.datasource
        flow = runtime.controller.producer.flow
        assert isinstance(ds, example.CountdownPrompts) and (ds.letter, ds.max_len) == ("c", 8)
        assert isinstance(flow, example.OneShotFlow)
        assert flow.reward_fn.fn is example.exact_length_reward  # run by the RewardRunner (threads, timeout)
        assert flow.rid_prefix == "countdown-"  # agentflow.flow_args
        assert flow.sampling.stop_token_ids == [example.char_ids()["eos"]]
        assert flow.max_response_length == 16

        sample = ds.next_sample()
        trajs = asyncio.run(flow.run_group(sample, seq=0, n=4))
        assert [t.status for t in trajs] == [TrajectoryStatus.COMPLETED] * 4
        n = sample.metadata["length"]
        assert trajs[0].reward == 1.0
        assert trajs[1].reward == pytest.approx(0.5 * n / (n + 1))
        assert [t.start_version for t in trajs] == [3] * 4
        assert {r.sampling_params.max_new_tokens for r in engine.requests} == {16}

        # Aborted at a step boundary: cancelled, unscored; resumed later from its tokens.
        flow.client = ScriptedEngine(abort=True)
        cut = asyncio.run(flow.run_group(sample, seq=1, n=2))
        assert [t.status for t in cut] == [TrajectoryStatus.CANCELLED] * 2 and cut[0].reward is None
        flow.client = resumed_engine = ScriptedEngine()
        again = PromptSample(sample.prompt_id, sample.input_ids, sample.metadata, resume=cut)
        done = asyncio.run(flow.run_group(again, seq=2, n=2))
        assert done[0].reward == 1.0 and len(done[0].response_ids) == n + 1
        assert resumed_engine.requests[0].input_ids == sample.input_ids + cut[0].response_ids
        assert resumed_engine.requests[0].sampling_params.max_new_tokens == 16 - 1
    finally:
        runtime.shutdown()


@pytest.mark.slow
def test_custom_rollout_example_trains(example, tmp_path):
    trainer = example.main(rollout_steps=2, root=str(tmp_path))
    cfg = example.make_config(rollout_steps=2)
    B = cfg.B
    assert trainer.global_step == 2 * cfg.minibatches_per_step

    # The rollout side the callback ran was the config's components.
    (callback,) = [c for c in trainer.callbacks if type(c).__name__ == "FullyAsyncCallback"]
    assert isinstance(callback.controller.state.datasource, example.CountdownPrompts)
    assert callback.controller.producer.flow.reward_fn.fn is example.exact_length_reward  # through the RewardRunner

    (log_dir,) = glob.glob(os.path.join(tmp_path, "lightning_logs", "version_*"))
    consumed = [r for r in read_jsonl(os.path.join(log_dir, "ledger.jsonl")) if r["kind"] == "consume"]
    assert len(consumed) == 2 * B and len({r["prompt"] for r in consumed}) == 2 * B
    # CountdownPrompts has 8 prompts per epoch (the default task has 4096): 16 distinct prompts
    # with indices below 8 can only have come from it, over two epochs.
    pids = [PromptId.parse(r["prompt"]) for r in consumed]
    assert all(p.index < 8 for p in pids) and max(p.epoch for p in pids) >= 1

    tb = read_scalars(log_dir)
    rewards = tb["rollout/reward_mean"]
    assert [s for s, _ in rewards] == [0, 1]
    assert all(0.0 <= v <= 1.0 for _, v in rewards)


# ------------------------------------------------------------------ a weight-sync path and a trainer backend


def _fit_with_plugins(tmp_path, *extra, timeout=600):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "examples"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
           f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
           "--fully_async.plugins=[weight_path_plugin, trainer_backend_plugin]", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def test_a_trainer_backends_refusal_and_a_missing_plugin_are_one_sentence_before_anything_starts(tmp_path):
    proc = _fit_with_plugins(tmp_path, "--trainer.strategy=frozen_embeddings", "--trainer.accumulate_grad_batches=2",
                             timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "`trainer.accumulate_grad_batches` is 2 under FrozenEmbeddingsStrategy" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _fit_with_plugins(tmp_path, "--fully_async.plugins=[no_such_plugin]", timeout=180)
    assert proc.returncode == 2
    assert "`fully_async.plugins` lists 'no_such_plugin', which cannot be imported" in proc.stderr


@pytest.mark.slow
def test_a_weight_path_and_a_trainer_backend_of_ones_own_train_through_the_command_line(tmp_path):
    """docs/extending.md's two plugins in one run: every weight sync goes over `checked-tensor` and is
    verified on the engine; under `frozen_embeddings` the CLI builds FrozenEmbeddingsPolicy, whose
    embeddings stay while the other weights move between two checkpoints."""
    import torch

    proc = _fit_with_plugins(tmp_path, "--rollout.weight_sync=checked-tensor", "--trainer.strategy=frozen_embeddings",
                             "--trainer.rollout_steps=2", "--trainer.save_freq=1", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "weight sync `checked-tensor`" in proc.stderr
    verified = [line for line in proc.stderr.splitlines() if line.startswith("checked-tensor: weight version")]
    assert verified == [f"checked-tensor: weight version {v} verified on 1 engine(s)" for v in (0, 1, 2)]
    (log_dir,) = glob.glob(os.path.join(tmp_path, "lightning_logs", "version_*"))
    first, second = (torch.load(os.path.join(log_dir, "checkpoints", f"step-00000{i}.ckpt"), weights_only=True,
                                map_location="cpu")["state_dict"] for i in (0, 1))
    embed = "policy.model.embed_tokens.weight"
    assert torch.equal(first[embed], second[embed])
    moved = [k for k in first if k != embed and not torch.equal(first[k], second[k])]
    assert len(moved) > len(first) // 2, moved

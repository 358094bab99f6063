"""Dropping the callback or the Fabric loop into one's own code: the refusals and messages a user
meets before and after training (no engine is started here; examples/own_policy.py trains under
both drivers in tests/integration/test_examples.py)."""

from __future__ import annotations

import os
import re
import signal
import sys
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lightning_fasync.config import ConfigError, load_config, validate
from lightning_fasync.lightning import FullyAsyncCallback, FullyAsyncFabricLoop, FullyAsyncHooks
from lightning_fasync.runtime.checkpoints import CheckpointFiles
from lightning_fasync.runtime.preemption import Preemption
from lightning_fasync.pipeline.controller import FullyAsyncController
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.engine_client import SamplingParams
from lightning_fasync.pipeline.flow import SingleTurnFlow
from lightning_fasync.testing.instant_engine import InstantEngine
from lightning_fasync.pipeline.reward_runner import RewardError, RewardRunner
from lightning_fasync.pipeline.state import PipelineError
from tests.helpers.paths import REPO

# B=4, N=2, M=4: (B x N) // M = 2 training calls per rollout step.
CONFIG = {"colocate": False, "fully_async": {"enable": True},
          "data_source": {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2},
          "trainer": {"mini_batch_size": 4}}


class _Policy(FullyAsyncHooks, pl.LightningModule):
    """A module with the contract but no train_dataloader()."""

    engine_model = "tiny"

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(torch.ones(2)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(max_steps):
    strategy = SimpleNamespace(root_device=torch.device("meta"))
    return SimpleNamespace(strategy=strategy, max_steps=max_steps, global_rank=0, world_size=1, local_rank=0,
                           log_dir=None, default_root_dir=None)


def test_a_max_steps_that_ends_inside_a_rollout_step_is_refused():
    cb = FullyAsyncCallback(CONFIG)
    with pytest.raises(ConfigError, match=r"`max_steps` is 5, which ends inside a rollout step.*multiple of 2 "
                                          r"\(e\.g\. 6 for 3 rollout steps\)"):
        cb.setup(_trainer(5), _Policy(), "fit")
    assert cb.runtime is None  # nothing started


def test_a_max_steps_other_than_the_configs_rollout_steps_is_refused_and_an_equal_one_is_not():
    cb = FullyAsyncCallback({**CONFIG, "trainer": {"mini_batch_size": 4, "rollout_steps": 3}})
    with pytest.raises(ConfigError, match=r"`trainer.rollout_steps` is 3 \(6 training calls\) but the Trainer's "
                                          r"`max_steps` is 4; .*Trainer\(max_steps=6\)"):
        cb.setup(_trainer(4), _Policy(), "fit")
    assert cb.runtime is None
    from lightning_fasync.lightning.callback import _check_fit_arguments

    _check_fit_arguments(SimpleNamespace(max_steps=6, accumulate_grad_batches=1), _Policy(), 2, 3)


def test_gradient_accumulation_over_training_calls_is_refused():
    cb = FullyAsyncCallback(CONFIG)
    trainer = _trainer(4)
    trainer.accumulate_grad_batches = 2
    with pytest.raises(ConfigError, match=r"`accumulate_grad_batches` is 2, but each training call is one optimizer "
                                          r"update"):
        cb.setup(trainer, _Policy(), "fit")
    assert cb.runtime is None


def test_fit_without_the_rollout_dataloader_says_what_to_return(tmp_path):
    cb = FullyAsyncCallback(CONFIG)
    trainer = pl.Trainer(max_steps=4, callbacks=[cb], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), accelerator="cpu")
    with pytest.raises(TypeError, match=r"_Policy has no train_dataloader\(\) and fit\(\) got no train_dataloaders; "
                                        r"return lightning_fasync\.lightning\.rollout_dataloader\(\)"):
        trainer.fit(_Policy())
    assert cb.runtime is None


def test_the_callback_is_the_trainers_checkpoint_callback_and_fit_last_finds_its_checkpoint(tmp_path):
    # A first run wrote version_0/checkpoints/step-000001.ckpt and its last.ckpt link; a second run
    # of the same script gets a new logger version, where Lightning's own ModelCheckpoint would look.
    old = CheckpointFiles(str(tmp_path / "lightning_logs" / "version_0" / "checkpoints"), None)
    saved = old.save(1, lambda path: open(path, "wb").close())
    cb = FullyAsyncCallback(CONFIG)
    trainer = pl.Trainer(max_steps=4, callbacks=[cb], default_root_dir=str(tmp_path), accelerator="cpu",
                         enable_progress_bar=False)
    assert trainer.checkpoint_callbacks == [cb]  # Lightning added no default ModelCheckpoint of its own
    assert trainer.loggers[0].version == 1
    # Lightning's own resolution of fit(ckpt_path="last"), as Trainer.fit runs it before setup.
    from lightning.pytorch.trainer.states import TrainerFn

    found = trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", model_provided=True,
                                                          model_connected=False)
    assert os.path.realpath(found) == os.path.realpath(saved)
    # Its state is still saved under the callback's own key (not ModelCheckpoint's, keyed by arguments).
    assert cb.state_key == "FullyAsyncCallback"
    # Without "last" nothing is resumed: a plain fit() starts fresh.
    assert trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, None, model_provided=True,
                                                         model_connected=False) is None


def test_the_signal_message_says_how_the_driver_in_use_resumes(capsys):
    saved = "/runs/x/checkpoints/step-000003.ckpt"

    def message(hint):
        preemption = Preemption(5.0, resume_hint=hint)
        preemption.signum = signal.SIGTERM
        assert preemption.stop(saved).code == 143
        return capsys.readouterr().err

    cb = FullyAsyncCallback(CONFIG)
    assert 'resume with `trainer.fit(..., ckpt_path="last")`' in message(lambda path: cb.resume_hint)
    assert "`--ckpt_path last`" not in message(lambda path: cb.resume_hint)
    loop = FullyAsyncFabricLoop(SimpleNamespace(), CONFIG, log_dir="/runs/x")
    fabric = message(loop.resume_hint)
    assert f'`rest = fabric.load("{saved}", {{"model": model, "optimizer": optimizer}})`' in fabric
    assert 'loop.fit(..., state=rest["fasync"])' in fabric
    assert "resume with `--ckpt_path last`" in message(lambda path: "`--ckpt_path last`")  # the CLI's


def test_the_cli_refuses_enable_checkpointing_false(capsys):
    from lightning_fasync.lightning.cli import main

    rc = main(["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"), "--trainer.enable_checkpointing=false"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "`trainer.enable_checkpointing` is false, but FullyAsyncCallback is the run's checkpoint callback" in err


def bad_reward(sample, trajectory):
    return sample.metadata["answer"]  # the prompts have no answer: KeyError


class BadReward:
    def __call__(self, sample, trajectory):
        return {"answer": 1}["missing"]


@pytest.mark.parametrize("reward", [bad_reward, BadReward()], ids=["function", "callable object"])
def test_a_reward_that_raises_is_named_with_its_own_frame(reward):
    import asyncio

    from lightning_fasync.types import PromptId, PromptSample, Trajectory

    runner = RewardRunner(reward, timeout_s=5.0, name="the reward passed to the driver")
    sample = PromptSample(PromptId(0, 0), [1, 2])
    try:
        with pytest.raises(RewardError) as info:
            asyncio.run(runner(sample, Trajectory.fresh(sample.prompt_id, 0, [1, 2], 0)))
    finally:
        runner.close()
    label, frame = ("bad_reward", "bad_reward") if reward is bad_reward else ("BadReward", "__call__")
    marker = "return sample.metadata[" if reward is bad_reward else 'return {"answer": 1}'
    line = next(i for i, text in enumerate(open(__file__), 1) if text.strip().startswith(marker))
    assert str(info.value).startswith(f"the reward passed to the driver ({__name__}:{label}) raised KeyError:")
    assert f" at {__file__}:{line} in {frame}: {marker}" in str(info.value)


def test_a_reward_in_worker_processes_is_named_with_its_own_frame():
    import asyncio

    from lightning_fasync.types import PromptId, PromptSample, Trajectory
    from tests.helpers import flaky_rewards  # the spawned worker imports it by this name too

    runner = RewardRunner(flaky_rewards.needs_an_answer, timeout_s=60.0, processes=1, name="data_source.reward")
    sample = PromptSample(PromptId(0, 0), [1, 2])
    try:
        with pytest.raises(RewardError, match=rf"raised KeyError: 'answer' at {flaky_rewards.__file__}:\d+ in "
                                              r"needs_an_answer: return float\(sample\.metadata\[\"answer\"\]"):
            asyncio.run(runner(sample, Trajectory.fresh(sample.prompt_id, 0, [1, 2], 0)))
    finally:
        runner.close()


def test_rewards_that_keep_failing_stop_the_run_naming_the_reward_not_the_engine(tmp_path):
    cfg = validate(load_config({**CONFIG, "rollout": {"max_response_length": 4, "max_consecutive_failed_groups": 2}}))
    engine = InstantEngine()
    runner = RewardRunner(bad_reward, timeout_s=5.0, name="the reward passed to the driver")
    flow = SingleTurnFlow(engine, SamplingParams(), 4, reward_fn=runner)
    ds = ListDataSource([([1, 2, i], {}) for i in range(64)], seed=1)
    ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=str(tmp_path))
    ctl.start()
    try:
        with pytest.raises(PipelineError) as info:
            ctl.fetch()
    finally:
        ctl.shutdown(raise_errors=False)
        runner.close()
    text = str(info.value)
    assert re.search(r"\d+ prompt groups in a row had a failed trajectory", text)
    assert f"; the reward failed: the reward passed to the driver ({__name__}:bad_reward) raised KeyError" in text
    assert f"at {__file__}:" in text and "Is the rollout engine up?" not in text


def test_engine_failures_still_point_at_the_engine(tmp_path):
    cfg = validate(load_config({**CONFIG, "rollout": {"max_response_length": 4, "max_consecutive_failed_groups": 2}}))
    engine = InstantEngine(fail_fn=lambda rid: True)
    flow = SingleTurnFlow(engine, SamplingParams(), 4, reward_fn=lambda s, t: 1.0)
    ctl = FullyAsyncController(cfg, ListDataSource([([1, 2, i], {}) for i in range(64)], seed=1), flow, engine,
                               log_dir=str(tmp_path))
    ctl.start()
    try:
        with pytest.raises(PipelineError, match=r"the rollout engine failed: .*Is the rollout engine up\?"):
            ctl.fetch()
    finally:
        ctl.shutdown(raise_errors=False)


def test_the_fabric_loop_takes_a_loss_tensor_or_a_dict_with_loss_and_refuses_the_rest():
    from lightning_fasync.lightning.fabric_loop import _loss_of

    loss = torch.tensor(1.5)
    assert _loss_of(loss) is loss and _loss_of({"loss": loss, "extra": 1}) is loss
    with pytest.raises(TypeError, match=r"training_step returned a NoneType; it must return the loss to minimise"):
        _loss_of(None)
    with pytest.raises(TypeError, match=r"returned a dict without a 'loss' entry \(keys: reward\)"):
        _loss_of({"reward": loss})
    with pytest.raises(TypeError, match=r"returned a tensor of shape \(2,\)"):
        _loss_of(torch.ones(2))


def test_the_fabric_loop_refuses_a_bad_clip_value_or_scheduler_before_anything_starts():
    module = _Policy()
    loop = FullyAsyncFabricLoop(SimpleNamespace(global_rank=0, world_size=1), CONFIG, log_dir="unused")
    optimizer = module.configure_optimizers()
    with pytest.raises(ConfigError, match=r"`gradient_clip_val` is 0; it must be > 0"):
        loop.fit(module, optimizer, 1, gradient_clip_val=0)
    with pytest.raises(TypeError, match=r"`lr_scheduler` is a dict, which has no step\(\)"):
        loop.fit(module, optimizer, 1, lr_scheduler={})
    assert loop.runtime is None
    steps = FullyAsyncFabricLoop(SimpleNamespace(global_rank=0, world_size=1),
                                 {**CONFIG, "trainer": {"mini_batch_size": 4, "rollout_steps": 3}}, log_dir="unused")
    with pytest.raises(ConfigError, match=r"`trainer.rollout_steps` is 3 but fit\(\) got rollout_steps=2"):
        steps.fit(module, optimizer, 2)
    assert steps.runtime is None


def test_the_policys_own_eos_ends_its_responses(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import own_policy
    finally:
        sys.path.pop(0)
    from lightning_fasync.data.files import policy_stop_token_ids
    from lightning_fasync.policy import load_tokenizer

    model_dir = own_policy.save_own_model(str(tmp_path / "model"))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.convert_ids_to_tokens(2) == "c"  # id 2 is an ordinary letter here
    assert policy_stop_token_ids(tokenizer, model_dir) == ([38], ["'<eos>'"])
    # The generation config's EOS counts too (a model may stop on several ids).
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=[38, 36]).save_pretrained(model_dir)
    assert policy_stop_token_ids(tokenizer, model_dir)[0] == [38, 36]


class _Engines(InstantEngine):
    """An engine client of the caller's own, which takes the weights as a mapping."""

    async def update_weights_from_tensor(self, tensors, weight_version=None):
        self.version = weight_version


@pytest.mark.parametrize("keys, said", [
    ({}, "colocate, the baseline: rollout and training take turns on the same resources (for fully-async set "
         "colocate: false and fully_async.enable: true)"),
    ({"colocate": False, "fully_async": {"enable": True, "sliding_window": "window-gated", "stale_steps": 2}},
     "fully-async (window-gated, fully_async.stale_steps 2)"),
], ids=["no mode keys", "fully-async"])
def test_the_run_says_its_mode_split_and_stop_tokens_at_start(tmp_path, keys, said):
    from lightning_fasync.fleet.resources import ResourcePlan
    from lightning_fasync.runtime.rollout_runtime import RolloutRuntime

    cfg = validate(load_config({**keys, "data_source": {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2},
                                "trainer": {"mini_batch_size": 4}}))
    plan = ResourcePlan(trainer_cores=[0], replica_cores=[[1]])
    runtime = RolloutRuntime(cfg, "tiny", plan, str(tmp_path), pin=False, client=_Engines())
    try:
        line = runtime.describe(plan)
    finally:
        runtime.shutdown()
    assert line.startswith(f"lightning-fasync: {said}; trainer on cores [0], engines of the client passed in; ")
    assert line.endswith("responses end at token ids [2] (the `repeat` task's EOS).")


def test_the_fabric_loop_clips_and_steps_the_scheduler_at_every_training_call(tmp_path):
    import lightning as L

    from lightning_fasync.lightning.batch import RolloutBatch

    norms = []

    class Probe:
        def on_before_optimizer_step(self, optimizer):
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[Probe()])
    module = _Policy()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loop = FullyAsyncFabricLoop(fabric, CONFIG, log_dir=str(tmp_path))
    loop._model, loop._optimizer, loop._hooks = model, optimizer, module
    loop._training_step = lambda batch: {"loss": 1000 * model.layer(torch.ones(2)).sum()}
    loop._clip, loop._scheduler = 0.5, scheduler
    loop._train_call(RolloutBatch(groups=[]))
    loop._clip = None
    loop._train_call(RolloutBatch(groups=[]))
    assert norms[0] == pytest.approx(0.5, rel=1e-4) and norms[1] > 100  # clipped only while asked to
    assert scheduler.last_epoch == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)


def test_the_run_summary_lists_what_the_run_wrote_with_commands_that_run_from_a_fresh_shell(tmp_path):
    from lightning_fasync.lightning.cli import run_summary

    def script(name):  # the interpreter's own console script, where the project is installed as one
        path = os.path.join(os.path.dirname(sys.executable), name)
        return path if os.access(path, os.X_OK) else name

    text = run_summary(str(tmp_path))
    assert f"{script('tensorboard')} --logdir {tmp_path}" in text
    assert "checkpoints:  none written" in text and "export" not in text
    assert "event log" not in text and "ledger" not in text  # nothing of them was written
    (tmp_path / "events.jsonl").write_text("")
    (tmp_path / "ledger.jsonl").write_text("")
    CheckpointFiles(str(tmp_path / "checkpoints"), None).save(0, lambda path: open(path, "wb").close())
    text = run_summary(str(tmp_path))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert f"export: {script('lightning-fasync')} export --ckpt_path {last} --out trained" in text
    assert f"timeline: {sys.executable} -m lightning_fasync.plots timeline {tmp_path / 'events.jsonl'}" in text
    assert f"ledger:       {tmp_path / 'ledger.jsonl'}" in text



@pytest.mark.parametrize("arg, said", [
    ("--fully_async.stale_step=1", "`--fully_async.stale_step` is not an option; did you mean `--fully_async.stale_steps`?"),
    ("--trainer.rolout_steps=3", "`--trainer.rolout_steps` is not an option; did you mean `--trainer.rollout_steps`?"),
], ids=["an abbreviation", "a misspelling"])
def test_a_mistyped_key_is_refused_in_one_line_naming_the_closest(capsys, arg, said):
    from lightning_fasync.lightning.cli import main

    assert main(["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"), arg, "--print_config"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [f"lightning-fasync fit: error: {said} (lightning-fasync fit --help "
                                                 "lists them)."]
    assert "stale_steps: 1.0" not in captured.out  # not taken as another key


def test_a_missing_config_file_is_one_line(capsys, tmp_path):
    from lightning_fasync.lightning.cli import main

    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"lightning-fasync fit: error: `config`: File does not exist: '{tmp_path / 'nope.yaml'}'"]


def test_max_steps_on_the_command_line_wins_over_the_configs_rollout_steps(capsys):
    from lightning_fasync.lightning.cli import CLI_KWARGS, FasyncCLI, main
    from lightning_fasync.lightning.module import RLPolicyModule

    config = os.path.join(REPO, "configs", "tiny_cpu.yaml")  # trainer.rollout_steps: 120, 4 calls per step
    cli = FasyncCLI(RLPolicyModule, args=["--config", config, "--trainer.max_steps=16"], run=False, **CLI_KWARGS)
    assert cli.trainer.max_steps == 16 and cli.fasync_config.trainer.rollout_steps == 4
    assert ("`--trainer.max_steps=16` from the command line counts: 4 rollout steps (the config's "
            "`trainer.rollout_steps` is overridden)") in capsys.readouterr().err
    # Both on the command line: which one is meant cannot be told.
    assert main(["--config", config, "--trainer.max_steps=16", "--trainer.rollout_steps=3"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main(["--config", config, "--trainer.max_steps=10"]) == 2  # 2.5 rollout steps
    assert "`trainer.max_steps` is 10, which ends inside a rollout step" in capsys.readouterr().err


def test_a_missing_dataset_is_refused_before_anything_starts(capsys, tmp_path):
    from lightning_fasync.lightning.cli import main

    missing, root = tmp_path / "nope.parquet", tmp_path / "run"
    rc = main(["--config", os.path.join(REPO, "configs", "tiny_cpu_math.yaml"), f"--data_source.path={missing}",
               f"--trainer.default_root_dir={root}"])
    assert rc == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"lightning-fasync fit: error: `data_source.path` '{missing}' does not exist.")
    assert not root.exists()  # no empty version_0/ left behind


def test_export_help_is_plain_text(capsys):
    from lightning_fasync.export.hf import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "Hugging Face directory" in text and ":func:" not in text and "``" not in text


def test_without_stop_ids_or_a_tokenizer_to_find_the_eos_the_run_is_refused(tmp_path):
    from lightning_fasync.fleet.resources import ResourcePlan
    from lightning_fasync.runtime.rollout_runtime import RolloutRuntime

    cfg = validate(load_config(CONFIG))
    plan = ResourcePlan(trainer_cores=[0], replica_cores=[[1]])
    prompts = ListDataSource([([1, 2, 3], {})])
    with pytest.raises(ConfigError, match=r"`rollout.stop_token_ids` is not set and the policy's tokenizer cannot be "
                                          r"loaded.*set rollout.stop_token_ids"):
        RolloutRuntime(cfg, None, plan, str(tmp_path), pin=False, client=_Engines(), datasource=prompts,
                       reward=lambda s, t: 0.0)
    # Given, they are used as they are.
    given = validate(load_config({**CONFIG, "rollout": {"stop_token_ids": [7]}}))
    runtime = RolloutRuntime(given, None, plan, str(tmp_path), pin=False, client=_Engines(), datasource=prompts,
                             reward=lambda s, t: 0.0)
    try:
        assert runtime.describe(plan).endswith("responses end at token ids [7] (rollout.stop_token_ids).")
    finally:
        runtime.shutdown()


def test_the_fit_command_drops_lightnings_chatter_and_says_what_it_trained(tmp_path):
    import logging

    from lightning_fasync.lightning.cli import _LightningChatter, run_summary

    def record(message):
        return logging.LogRecord("lightning.pytorch.utilities.rank_zero", logging.INFO, __file__, 1, message, None, None)

    quiet = _LightningChatter()
    assert not quiet.filter(record("`Trainer.fit` stopped: `max_steps=80` reached."))  # training calls, on the bar's line
    assert not quiet.filter(record("💡 Tip: For seamless cloud logging and experiment tracking, try installing ..."))
    assert quiet.filter(record("GPU available: False, used: False"))
    assert run_summary(str(tmp_path), 20, 80).splitlines()[1] == "Trained 20 rollout steps (80 training calls)."

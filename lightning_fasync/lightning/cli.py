"""``lightning-fasync fit`` through LightningCLI.

Every spec key is a CLI/YAML key with the spec's name: ``--fully_async.stale_steps=2``,
``--colocate=false``, ``--rollout.partial=true``. The spec's RL ``trainer.*`` keys
(``mini_batch_size``, ``save_freq``, ``use_rollout_log_probs``, ``num_gpus_per_node``) sit in
Lightning's own ``trainer`` group next to the Trainer's arguments (``trainer.num_nodes`` is shared:
it means the same in both); they are taken out before the Trainer is built.

The plugin config is validated before anything is instantiated; a refused config prints its
one-sentence error and exits with status 2.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

from jsonargparse import lazy_instance
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI

from lightning_fasync.config import ConfigError, FasyncConfig, TrainerConfig, add_config_arguments, config_from_namespace, validate
from lightning_fasync.lightning.callback import FullyAsyncCallback
from lightning_fasync.lightning.checkpoints import find_last
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.lightning.progress import RolloutProgressBar
from lightning_fasync.lightning.strategy import FullyAsyncStrategy
from lightning_fasync.megatron.strategy import MegatronStrategy  # noqa: F401 - --trainer.strategy=MegatronStrategy

# Spec keys under `trainer.` that Lightning's Trainer does not take (`num_nodes` means the same in both).
RL_TRAINER_KEYS = [k for k in TrainerConfig.__dataclass_fields__ if k != "num_nodes"]


class FasyncCLI(LightningCLI):
    """LightningCLI with the plugin's config groups; the policy's algorithm arguments are linked
    from the spec's top-level keys, so each is given once."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse parser
        add_config_arguments(parser, skip_trainer=["num_nodes"])
        parser.link_arguments("algorithm", "model.algorithm")
        parser.link_arguments("trainer.use_rollout_log_probs", "model.use_rollout_log_probs")
        parser.link_arguments("rollout.mask_offpolicy_in_partial_rollout", "model.mask_offpolicy_in_partial_rollout")
        parser.link_arguments("rollout.temperature", "model.rollout_temperature")

    def before_instantiate_classes(self) -> None:
        ns = self.config[self.subcommand] if self.subcommand else self.config
        trainer_ns = ns["trainer"]
        cfg, _ = config_from_namespace(ns)
        validate(cfg)
        self.fasync_config: FasyncConfig = cfg
        if cfg.trainer.rollout_steps is not None:
            calls = cfg.trainer.rollout_steps * cfg.minibatches_per_step
            if trainer_ns.get("max_steps") not in (None, -1, calls):
                raise ConfigError(
                    f"`trainer.max_steps` is {trainer_ns['max_steps']} while `trainer.rollout_steps` is "
                    f"{cfg.trainer.rollout_steps}; give one of them (max_steps counts training calls, "
                    f"{cfg.minibatches_per_step} per rollout step)."
                )
            trainer_ns["max_steps"] = calls
        if ns.get("ckpt_path") == "last":
            ns["ckpt_path"] = find_last_checkpoint(trainer_ns.get("default_root_dir") or ".")
        if trainer_ns.get("enable_checkpointing") is False:
            raise ConfigError(
                "`trainer.enable_checkpointing` is false, but FullyAsyncCallback is the run's checkpoint callback (a "
                "ModelCheckpoint, which Lightning refuses beside it): drop the key; `trainer.save_freq` sets how often "
                "checkpoints are written (0: only on SIGTERM and lost engines)."
            )
        for key in RL_TRAINER_KEYS:
            del trainer_ns[key]
        if self.model_class.__name__ == "MegatronPolicyModule" and trainer_ns.get("gradient_clip_val") is not None:
            raise ConfigError(
                f"`trainer.gradient_clip_val` is {trainer_ns['gradient_clip_val']} under MegatronStrategy, whose optimizer "
                f"is megatron-core's: set `model.grad_clip: {trainer_ns['gradient_clip_val']}` and "
                "`trainer.gradient_clip_val: null` (Lightning clips only under automatic optimisation)."
            )

    def instantiate_trainer(self, **kwargs: Any):
        init = self.config_init[self.subcommand] if self.subcommand else self.config_init
        # The config's own --trainer.callbacks first: LightningCLI lets a `callbacks` argument replace them.
        configured = init["trainer"].get("callbacks") or []
        callbacks = list(configured if isinstance(configured, list) else [configured])
        callbacks += list(kwargs.pop("callbacks", None) or [])
        if not any(isinstance(c, FullyAsyncCallback) for c in callbacks):
            callbacks.append(FullyAsyncCallback(self.fasync_config))
        for callback in callbacks:
            if isinstance(callback, FullyAsyncCallback):
                callback.resume_hint = "`--ckpt_path last`"
        bar = kwargs.get("enable_progress_bar", init["trainer"].get("enable_progress_bar"))
        if bar is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(RolloutProgressBar(self.fasync_config.minibatches_per_step))
        kwargs["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)


def find_last_checkpoint(root: str) -> str:
    """The checkpoint the newest ``last.ckpt`` under ``root`` points to (for ``--ckpt_path last``)."""
    found = find_last(root)
    if found is None:
        raise ConfigError(
            f"`ckpt_path` is 'last', but no checkpoints/last.ckpt exists under {root!r} "
            "(set trainer.save_freq so checkpoints are written, or give the checkpoint's path)."
        )
    return found


def _where_it_went(cli: FasyncCLI) -> None:
    """End the run by saying where its logs, checkpoints and event log are, and how to look."""
    trainer = getattr(cli, "trainer", None)
    if trainer is None or not trainer.is_global_zero:
        return
    # The callback resolved the log dir in setup (trainer.log_dir is a collective under DDP).
    log_dir = next((c.log_dir for c in trainer.callbacks if isinstance(c, FullyAsyncCallback)), None)
    if not log_dir or not os.path.isdir(log_dir):
        return
    print(
        f"\nRun directory: {log_dir}\n"
        f"  metrics:      tensorboard --logdir {log_dir}\n"
        f"  checkpoints:  {os.path.join(log_dir, 'checkpoints')}\n"
        f"  event log:    {os.path.join(log_dir, 'events.jsonl')} "
        f"(timeline: python -m lightning_fasync.plots timeline {os.path.join(log_dir, 'events.jsonl')} timeline.png)\n"
        f"  ledger:       {os.path.join(log_dir, 'ledger.jsonl')}"
    )


MEGATRON_STRATEGY_NAMES = ("MegatronStrategy", "lightning_fasync.megatron.MegatronStrategy",
                           "lightning_fasync.megatron.strategy.MegatronStrategy", "megatron")


def _strategy_named(args: Sequence[str]) -> Optional[str]:
    """The ``trainer.strategy`` the command line (or, failing that, its ``--config`` files, the last
    one that sets it) names, as a class name or path; None when neither does."""
    import yaml

    named: Optional[str] = None
    configs: list[str] = []
    for i, arg in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else None
        for key in ("--trainer.strategy", "--trainer.strategy.class_path"):
            if arg == key and value is not None:
                named = value
            elif arg.startswith(key + "="):
                named = arg.split("=", 1)[1]
        if arg in ("--config", "-c") and value is not None:
            configs.append(value)
        elif arg.startswith("--config="):
            configs.append(arg.split("=", 1)[1])
    if named is not None:
        return named
    for path in configs:
        try:
            with open(path) as f:
                strategy = ((yaml.safe_load(f) or {}).get("trainer") or {}).get("strategy")
        except (OSError, yaml.YAMLError, AttributeError):
            continue  # the CLI's own parser reports it
        if isinstance(strategy, dict):
            strategy = strategy.get("class_path")
        if isinstance(strategy, str):
            named = strategy
    return named


def policy_class(args: Sequence[str]) -> type:
    """The policy module the CLI builds from ``model.*``: :class:`RLPolicyModule`, or under
    ``MegatronStrategy`` its megatron-core counterpart
    :class:`~lightning_fasync.megatron.MegatronPolicyModule` (the same keys, plus
    ``micro_batch_size`` and ``grad_clip``)."""
    if _strategy_named(args) in MEGATRON_STRATEGY_NAMES:
        from lightning_fasync.megatron.module import MegatronPolicyModule

        return MegatronPolicyModule
    return RLPolicyModule


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-fasync fit ...``: returns the exit status."""
    if argv is None:
        # Parse the process's own command line (`lightning-fasync fit ...`): a DDP launcher
        # re-runs exactly that command line in each rank's process.
        if not any(a.startswith("--weights_only") for a in sys.argv):
            # Resume reads the checkpoint with torch.load(weights_only=True): no arbitrary pickle.
            sys.argv.append("--weights_only=true")
        args = None
    else:
        args = ["fit", *argv]
        if not any(a.startswith("--weights_only") for a in args):
            args.append("--weights_only=true")
    try:
        cli = FasyncCLI(
            policy_class(sys.argv[1:] if args is None else args),
            args=args,
            trainer_defaults={"strategy": lazy_instance(FullyAsyncStrategy), "max_epochs": -1, "log_every_n_steps": 1},
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"fit": {"default_env": False}},
        )
    except ConfigError as exc:
        print(f"lightning-fasync fit: error: {exc}", file=sys.stderr)
        return 2
    _where_it_went(cli)
    return 0

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

import glob
import os
import sys
import typing
from dataclasses import MISSING, asdict, fields
from typing import Any, Optional, Sequence

from jsonargparse import lazy_instance
from lightning.pytorch.cli import LightningCLI

from lightning_fasync.config import (
    AgentFlowConfig,
    AlgorithmConfig,
    ConfigError,
    DataSourceConfig,
    FasyncConfig,
    FullyAsyncConfig,
    RolloutConfig,
    TrainerConfig,
    config_from_dict,
    validate,
)
from lightning_fasync.lightning.callback import FullyAsyncCallback
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.lightning.strategy import FullyAsyncStrategy

# Spec keys under `trainer.` that Lightning's Trainer does not take.
RL_TRAINER_KEYS = [f.name for f in fields(TrainerConfig) if f.name != "num_nodes"]
_FIELD_DOCS = {
    "mini_batch_size": "M: trajectories per training call; each call fetches M // N complete groups.",
    "num_gpus_per_node": "Training GPUs per node in the resident training pool (spec key).",
    "save_freq": "Save a checkpoint every this many rollout steps; 0 saves none periodically.",
    "use_rollout_log_probs": "Use the engine's log-probs as the old policy instead of recomputing them.",
}


def _namespace_dict(ns: Any) -> Any:
    return ns.as_dict() if hasattr(ns, "as_dict") else ns


class FasyncCLI(LightningCLI):
    """LightningCLI with the plugin's config groups."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse parser
        parser.add_class_arguments(FullyAsyncConfig, "fully_async")
        parser.add_argument("--colocate", type=bool, default=True, help="Rollout and trainer share one resource pool.")
        parser.add_argument("--run_mode", type=str, default="default", help="Entry mode; fully-async supports only default.")
        parser.add_class_arguments(DataSourceConfig, "data_source")
        parser.add_argument("--data_sources", type=Optional[list[DataSourceConfig]], default=None, help="Data sources; null means [data_source].")
        hints = typing.get_type_hints(TrainerConfig)
        for f in fields(TrainerConfig):
            if f.name in RL_TRAINER_KEYS:
                default = f.default if f.default is not MISSING else None
                parser.add_argument(f"--trainer.{f.name}", type=hints[f.name], default=default, help=_FIELD_DOCS.get(f.name))
        parser.add_class_arguments(RolloutConfig, "rollout")
        # jsonargparse cannot write dataclass instances nested in a dict back to YAML; a plain dict
        # default keeps the saved config.yaml reusable.
        parser.set_defaults({"rollout.sglang_replicas": {k: asdict(v) for k, v in RolloutConfig().sglang_replicas.items()}})
        parser.add_class_arguments(AgentFlowConfig, "agentflow")
        parser.add_class_arguments(AlgorithmConfig, "algorithm")

    def before_instantiate_classes(self) -> None:
        ns = self.config[self.subcommand] if self.subcommand else self.config
        trainer_ns = ns["trainer"]
        data: dict[str, Any] = {
            "fully_async": _namespace_dict(ns["fully_async"]),
            "colocate": ns["colocate"],
            "run_mode": ns["run_mode"],
            "data_source": _namespace_dict(ns["data_source"]),
            "data_sources": None if ns["data_sources"] is None else [_namespace_dict(s) for s in ns["data_sources"]],
            "trainer": {k: trainer_ns[k] for k in RL_TRAINER_KEYS} | {"num_nodes": trainer_ns["num_nodes"]},
            "rollout": _namespace_dict(ns["rollout"]),
            "agentflow": _namespace_dict(ns["agentflow"]),
            "algorithm": _namespace_dict(ns["algorithm"]),
        }
        cfg = config_from_dict(_plain(data))
        validate(cfg)
        self.fasync_config: FasyncConfig = cfg
        if ns.get("ckpt_path") == "last":
            ns["ckpt_path"] = find_last_checkpoint(trainer_ns.get("default_root_dir") or ".")
        for key in RL_TRAINER_KEYS:
            del trainer_ns[key]

    def instantiate_trainer(self, **kwargs: Any):
        callbacks = list(kwargs.pop("callbacks", None) or [])
        if not any(isinstance(c, FullyAsyncCallback) for c in callbacks):
            callbacks.append(FullyAsyncCallback(self.fasync_config))
        kwargs["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)


def find_last_checkpoint(root: str) -> str:
    """The newest ``last.ckpt`` the callback wrote under ``root`` (for ``--ckpt_path last``)."""
    found = glob.glob(os.path.join(root, "**", "checkpoints", "last.ckpt"), recursive=True)
    if not found:
        raise ConfigError(
            f"`ckpt_path` is 'last', but no checkpoints/last.ckpt exists under {root!r} "
            "(set trainer.save_freq so checkpoints are written, or give the checkpoint's path)."
        )
    return max(found, key=os.path.getmtime)


def _plain(obj: Any) -> Any:
    """jsonargparse namespaces and tuples → plain dicts and lists."""
    if hasattr(obj, "as_dict"):
        obj = obj.as_dict()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if not k.startswith("__")}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


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
        FasyncCLI(
            RLPolicyModule,
            args=args,
            trainer_defaults={"strategy": lazy_instance(FullyAsyncStrategy), "max_epochs": -1, "log_every_n_steps": 1},
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"fit": {"default_env": False}},
        )
    except ConfigError as exc:
        print(f"lightning-fasync fit: error: {exc}", file=sys.stderr)
        return 2
    return 0

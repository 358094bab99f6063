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

import logging
import os
import sys
import warnings
from argparse import ArgumentError
from typing import Any, Optional, Sequence

from jsonargparse import lazy_instance
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI

from lightning_fasync.config import (ConfigError, FasyncConfig, TrainerConfig, _config_error_sentence, add_config_arguments,
                                     config_from_namespace, import_plugins, validate)
from lightning_fasync.registry import TRAINERS, load_path, trainer_backend_named
from lightning_fasync.lightning.callback import FullyAsyncCallback
from lightning_fasync.runtime.checkpoints import find_last
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.lightning.progress import RolloutProgressBar
from lightning_fasync.lightning.strategy import FullyAsyncStrategy

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
        parser.link_arguments("trainer.pack_sequences", "model.pack_sequences")
        parser.link_arguments("trainer.max_tokens_per_micro_batch", "model.max_tokens_per_micro_batch")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("args")
        self._argv = [str(a) for a in (given if isinstance(given, (list, tuple)) else sys.argv[1:])]
        register_trainer_backends()  # --trainer.strategy=MegatronStrategy resolves
        super().__init__(*args, **kwargs)

    def parse_arguments(self, parser, args) -> None:  # noqa: ANN001 - jsonargparse parser
        """Parse as LightningCLI does; a refused command line is one sentence (the parser does not
        exit on errors here: no page of usage), with the closest key for a mistyped one."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as exc:
            raise ConfigError(argument_error_sentence(exc, parser)) from None

    def before_instantiate_classes(self) -> None:
        ns = self.config[self.subcommand] if self.subcommand else self.config
        trainer_ns = ns["trainer"]
        cfg, _ = config_from_namespace(ns)
        validate(cfg)
        _check_data_paths(cfg)
        self.fasync_config: FasyncConfig = cfg
        if cfg.trainer.rollout_steps is not None:
            calls = cfg.trainer.rollout_steps * cfg.minibatches_per_step
            max_steps = trainer_ns.get("max_steps")
            if max_steps not in (None, -1, calls):
                # As everywhere in LightningCLI, what the command line gives wins over the config files.
                given = {key for key in ("trainer.max_steps", "trainer.rollout_steps") if _on_command_line(self._argv, key)}
                if given != {"trainer.max_steps"}:
                    raise ConfigError(
                        f"`trainer.max_steps` is {max_steps} while `trainer.rollout_steps` is "
                        f"{cfg.trainer.rollout_steps}; give one of them (max_steps counts training calls, "
                        f"{cfg.minibatches_per_step} per rollout step)."
                    )
                if max_steps % cfg.minibatches_per_step:
                    raise ConfigError(
                        f"`trainer.max_steps` is {max_steps}, which ends inside a rollout step: each rollout step is "
                        f"{cfg.minibatches_per_step} training calls, so give a multiple of {cfg.minibatches_per_step}."
                    )
                cfg.trainer.rollout_steps = max_steps // cfg.minibatches_per_step
                print(f"lightning-fasync fit: `--trainer.max_steps={max_steps}` from the command line counts: "
                      f"{cfg.trainer.rollout_steps} rollout steps (the config's `trainer.rollout_steps` is overridden).",
                      file=sys.stderr)
                calls = max_steps
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
        backend = trainer_backend_named(_strategy_named(self._argv))
        if backend is not None and backend.check_cli is not None:
            backend.check_cli(trainer_ns)

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


def _check_data_paths(cfg: FasyncConfig) -> None:
    """Refuse, before any directory, engine or thread exists, a ``data_source.path`` (or an eval
    set's) that is not there or holds no readable files."""
    from lightning_fasync.data.files import _resolve_files

    named = [("data_source", src) for src in cfg.sources]
    named += [(f"eval.data_source[{i}]", src) for i, src in enumerate(cfg.eval.data_source)]
    for key, src in named:
        if not src.path:
            continue
        try:
            _resolve_files(src.path, src.format)
        except (OSError, ValueError) as exc:
            raise ConfigError(str(exc).replace("`data_source.", f"`{key}.")) from None


def _on_command_line(argv: Sequence[str], key: str) -> bool:
    """Whether ``--key`` (or ``--key=value``) is on the command line itself, not in a config file."""
    return any(a == f"--{key}" or a.startswith(f"--{key}=") for a in argv)


def _option_strings(parser: Any) -> list[str]:
    """Every ``--option`` of ``parser`` and of its subcommands' parsers."""
    out: list[str] = []
    for action in getattr(parser, "_actions", []):
        out += [o for o in action.option_strings if o.startswith("--")]
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict):
            for sub in choices.values():
                if hasattr(sub, "_actions"):
                    out += _option_strings(sub)
    return out


def argument_error_sentence(exc: BaseException, parser: Any) -> str:
    """The parser's error as one sentence: an unrecognized option (a misspelling, or an
    abbreviation, which is refused) gets the closest valid one; the rest as the config loader says it."""
    import difflib
    import re

    text = " ".join(str(exc).split())
    m = re.search(r"[Uu]nrecognized arguments: (.*)$", text)
    if m is None:
        return _config_error_sentence(exc)
    known = sorted(set(_option_strings(parser)))
    parts = []
    for arg in m.group(1).split():
        if not arg.startswith("--"):
            continue
        key = arg.split("=", 1)[0]
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        parts.append(f"`{key}` is not an option{hint}")
    return ("; ".join(parts) or f"unrecognized arguments: {m.group(1)}") + " (lightning-fasync fit --help lists them)."


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
    """End the run by saying where its logs, checkpoints and event log are, and how to look: only
    what the run wrote, with commands that run from a fresh shell (this interpreter's own scripts)."""
    trainer = getattr(cli, "trainer", None)
    if trainer is None or not trainer.is_global_zero:
        return
    # The callback resolved the log dir in setup (trainer.log_dir is a collective under DDP).
    callback = next((c for c in trainer.callbacks if isinstance(c, FullyAsyncCallback)), None)
    log_dir = callback.log_dir if callback is not None else None
    if not log_dir or not os.path.isdir(log_dir):
        return
    steps = callback.controller.rollout_step if callback.controller is not None else None
    print(run_summary(log_dir, steps, trainer.global_step))


def run_summary(log_dir: str, rollout_steps: Optional[int] = None, calls: Optional[int] = None) -> str:
    """The closing lines of a ``fit`` run in ``log_dir``: the steps it trained (``rollout_steps``
    rollout steps, ``calls`` training calls), then where everything is."""
    bindir = os.path.dirname(sys.executable)

    def script(name: str) -> str:  # the venv's console script when it is there, else the bare name
        path = os.path.join(bindir, name)
        return path if os.access(path, os.X_OK) else name

    lines = [f"\nTrained {rollout_steps} rollout steps ({calls} training calls)."] if rollout_steps is not None else []
    lines += [f"Run directory: {log_dir}", f"  metrics:      {script('tensorboard')} --logdir {log_dir}"]
    checkpoints = os.path.join(log_dir, "checkpoints")
    last = os.path.join(checkpoints, "last.ckpt")
    if os.path.lexists(last):
        lines.append(f"  checkpoints:  {checkpoints} (resume: --ckpt_path last; export: {script('lightning-fasync')} "
                     f"export --ckpt_path {last} --out trained)")
    else:
        lines.append("  checkpoints:  none written (`trainer.save_freq` sets how often; 0 saves only on SIGTERM or lost "
                     "engines)")
    events = os.path.join(log_dir, "events.jsonl")
    if os.path.isfile(events):
        lines.append(f"  event log:    {events} (timeline: {sys.executable} -m lightning_fasync.plots timeline {events} "
                     "timeline.png)")
    ledger = os.path.join(log_dir, "ledger.jsonl")
    if os.path.isfile(ledger):
        lines.append(f"  ledger:       {ledger}")
    return "\n".join(lines)


def register_trainer_backends() -> None:
    """Make every registered trainer backend's strategy nameable on the command line (its class
    imported for jsonargparse, its Lightning registry entries made)."""
    for backend in TRAINERS.entries():
        if backend.strategy_class is not None:
            load_path(backend.strategy_class)
        if backend.register is not None:
            backend.register()


def _named(args: Sequence[str], keys: Sequence[str], path: Sequence[str]) -> Any:
    """What the command line (``--KEY VALUE`` or ``--KEY=VALUE`` for a key of ``keys``) or, failing
    that, its ``--config`` files (the last one that sets ``path``) give, unparsed; None when neither does."""
    import yaml

    named: Any = None
    configs: list[str] = []
    for i, arg in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else None
        for key in keys:
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
    for config in configs:
        try:
            with open(config) as f:
                node: Any = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            continue  # the CLI's own parser reports it
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            named = node
    return named


def _strategy_named(args: Sequence[str]) -> Optional[str]:
    """The ``trainer.strategy`` the command line (or, failing that, its ``--config`` files, the last
    one that sets it) names, as a class name or path; None when neither does."""
    strategy = _named(args, ("--trainer.strategy", "--trainer.strategy.class_path"), ("trainer", "strategy"))
    if isinstance(strategy, dict):
        strategy = strategy.get("class_path")
    return strategy if isinstance(strategy, str) else None


def import_plugins_named(args: Sequence[str]) -> None:
    """Import the ``fully_async.plugins`` the arguments name, before anything is parsed: a plugin
    may register a trainer backend whose strategy the command line names.

    Raises:
        ConfigError: a plugin that cannot be imported.
    """
    import yaml

    plugins = _named(args, ("--fully_async.plugins",), ("fully_async", "plugins"))
    if isinstance(plugins, str):
        try:
            plugins = yaml.safe_load(plugins)
        except yaml.YAMLError:
            return  # the CLI's own parser reports it
        plugins = [plugins] if isinstance(plugins, str) else plugins
    if isinstance(plugins, list):
        import_plugins([str(module) for module in plugins])


def policy_class(args: Sequence[str]) -> type:
    """The policy module the CLI builds from ``model.*``: :class:`RLPolicyModule`, or the
    ``module_class`` of the trainer backend whose strategy the arguments name (under
    ``MegatronStrategy``: :class:`~lightning_fasync.trainers.megatron.MegatronPolicyModule`, the
    same keys plus ``micro_batch_size`` and ``grad_clip``)."""
    backend = trainer_backend_named(_strategy_named(args))
    if backend is not None and backend.module_class is not None:
        return load_path(backend.module_class)
    return RLPolicyModule


#: How ``lightning-fasync fit`` builds its LightningCLI. The parsers refuse abbreviated options and
#: raise instead of exiting on an error, which the CLI turns into one sentence.
CLI_KWARGS: dict[str, Any] = dict(
    # No model summary: its FLOPs column reads 0 for a policy trained on rollouts; the start-up line says what runs.
    trainer_defaults={"strategy": lazy_instance(FullyAsyncStrategy), "max_epochs": -1, "log_every_n_steps": 1,
                      "enable_model_summary": False},
    save_config_kwargs={"overwrite": True},
    parser_kwargs={"fit": {"default_env": False, "allow_abbrev": False, "exit_on_error": False},
                   "allow_abbrev": False, "exit_on_error": False, "default_env": False},
)


class _ParseOnly(FasyncCLI):
    """``fit``'s parsing and checks (overrides, links, ``validate``), without building anything."""

    def instantiate_classes(self) -> None:
        pass


def parse_fit_args(args: Sequence[str]) -> tuple[FasyncConfig, Any]:
    """What ``lightning-fasync fit ARGS`` would run, parsed exactly as ``fit`` parses it, nothing
    built: the validated plugin config and the rest of the namespace (``model``, ``trainer``; its
    spec ``trainer.*`` keys are in the plugin config).

    Raises:
        ConfigError: a refused command line or config, in one sentence.
    """
    args = [str(a) for a in args]
    import_plugins_named(args)
    kwargs = {**CLI_KWARGS, "parser_kwargs": {k: v for k, v in CLI_KWARGS["parser_kwargs"].items() if k != "fit"}}
    with warnings.catch_warnings():  # called from another command line (plan's): its own argv is not fit's
        warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
        cli = _ParseOnly(policy_class(args), args=args, run=False, save_config_callback=None, seed_everything_default=None,
                         **{k: v for k, v in kwargs.items() if k != "save_config_kwargs"})
    return cli.fasync_config, cli.config


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
    quiet = _LightningChatter()
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_log.addFilter(quiet)
    # Lightning's own use of a torch.utils._pytree name that torch deprecates: nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    try:
        given = sys.argv[1:] if args is None else args
        import_plugins_named(given)
        cli = FasyncCLI(policy_class(given), args=args, **CLI_KWARGS)
    except ConfigError as exc:
        print(f"lightning-fasync fit: error: {exc}", file=sys.stderr)
        return 2
    finally:
        rank_zero_log.removeFilter(quiet)
    _where_it_went(cli)
    return 0


class _LightningChatter(logging.Filter):
    """Lightning's lines that say nothing about this run: the litlogger advertisement, and "`Trainer.fit`
    stopped: `max_steps=N` reached" in training calls, printed on the progress bar's line (the
    closing summary says how many rollout steps and training calls were trained)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("💡 Tip: For seamless cloud logging")
                    or message.startswith("`Trainer.fit` stopped: `max_steps="))

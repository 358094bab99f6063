"""What varies between runs, registered by name: sliding windows, engine backends, weight-sync
paths and trainer backends (torchtitan's ``TrainSpec`` is the model: one record per backend).

Each registry maps the name a config gives (``fully_async.sliding_window``, ``rollout.backend``,
``rollout.weight_sync``, the trainer's strategy) to one entry. A built-in entry is named by its
import path (``"package.module:NAME"``) and imported on first use, so the config can check a name
without importing the packages that implement it, and this module imports nothing of the package
but :mod:`lightning_fasync.errors`. Your own entry is registered from your module, listed in
``fully_async.plugins`` so that it is imported before the config is validated::

    from lightning_fasync.registry import WEIGHT_PATHS, WeightPath

    WEIGHT_PATHS.register("my-path", WeightPath(name="my-path", make=MySync, client_method="update_weights_from_tensor"))

``docs/extending.md`` walks through a weight-sync path and a trainer backend.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Generic, Mapping, Optional, Sequence, TypeVar

from lightning_fasync.errors import ConfigError

__all__ = [
    "ENGINE_BACKENDS", "TRAINERS", "WEIGHT_PATHS", "WINDOWS", "EngineBackend", "EngineStart", "Registry",
    "TrainerBackend", "WeightPath", "load_path", "trainer_backend_named",
    "weight_sync_choices",
]

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name; built-ins given as ``"package.module:NAME"`` and imported on first use.

    Arguments:
        key: the config key the name is given under, for error messages.
        what: what an entry is ("engine backend"), for error messages.
        builtins: name -> import path of the built-in entries.
        hint: where to read how to add one, appended to the unknown-name sentence.
    """

    def __init__(self, key: str, what: str, builtins: Optional[Mapping[str, str]] = None, hint: str = "") -> None:
        self.key = key
        self.what = what
        self.hint = hint
        self._paths: dict[str, str] = dict(builtins or {})
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: Optional[T] = None, *, replace: bool = False) -> Any:
        """Register ``entry`` under ``name``; without ``entry``, a decorator that registers what it decorates.

        Raises:
            ValueError: ``name`` is taken by another entry (pass ``replace=True`` to override it).
        """

        def _register(e: T) -> T:
            existing = self._entries.get(name)
            if not replace and ((existing is not None and existing is not e)
                                or (existing is None and name in self._paths)):
                raise ValueError(
                    f"A {self.what} named {name!r} is already registered "
                    f"({existing if existing is not None else self._paths[name]!r}); pick another name or pass replace=True."
                )
            if replace:
                self._paths.pop(name, None)
            self._entries[name] = e
            return e

        return _register(entry) if entry is not None else _register

    def unregister(self, name: str) -> None:
        """Forget an entry registered here (a built-in is forgotten only if it was replaced)."""
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        """Every registered name: the built-ins in their order, then the others as registered."""
        return list(dict.fromkeys([*self._paths, *self._entries]))

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._paths

    def get(self, name: str, key: Optional[str] = None) -> T:
        """The entry registered under ``name``.

        Raises:
            ConfigError: no such entry, naming ``key`` (default: the registry's) and the names there are.
        """
        if name in self._entries:
            return self._entries[name]
        path = self._paths.get(name)
        if path is None:
            raise ConfigError(
                f"`{key or self.key}` is {name!r}, which is not a registered {self.what}; it must be one of "
                f"{', '.join(self.names())}{self.hint}."
            )
        entry = load_path(path)
        self._entries[name] = entry
        return entry

    def entries(self) -> list[T]:
        """Every entry, the built-ins imported."""
        return [self.get(name) for name in self.names()]


# --------------------------------------------------------------------------------------------
# Sliding windows (docs/contract.md §3): a factory of WindowStrategy objects per name
# --------------------------------------------------------------------------------------------

WINDOWS: Registry[Callable[[], Any]] = Registry(
    "fully_async.sliding_window", "sliding-window strategy",
    {"no-window": "lightning_fasync.pipeline.window:NoWindow",
     "window-gated": "lightning_fasync.pipeline.window:WindowGated",
     "windowed-fifo": "lightning_fasync.pipeline.window:WindowedFifo",
     "staleness-bounded": "lightning_fasync.pipeline.window:StalenessBounded"},
    hint=" or register yours (see docs/custom_window.md)",
)


# --------------------------------------------------------------------------------------------
# Engine backends (``rollout.backend``, docs/backends.md)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineStart:
    """What the runtime knows when it starts a backend's engines (main thread, before training).

    Attributes:
        cfg: the run's config.
        engine_model: the policy the engines load (a preset name or a local directory), or None.
        plan: the machine's split (:class:`~lightning_fasync.fleet.resources.ResourcePlan`).
        prepared: what the backend's ``prepare`` returned (e.g. SGLang's GPU plan), or None.
        context_length: the engines' context length in tokens.
        log_dir: the run's log directory, or None.
        startup_timeout: seconds the engines may take to answer ``/health``.
        engine_threads: torch threads per CPU engine replica, or None (the plan's cores).
        server_args: flags the run itself needs on every server it launches (``--enable-memory-saver``).
    """

    cfg: Any
    engine_model: Optional[str]
    plan: Any
    prepared: Any
    context_length: int
    log_dir: Optional[str]
    startup_timeout: float
    engine_threads: Optional[int] = None
    server_args: Sequence[str] = ()


@dataclass(frozen=True)
class EngineBackend:
    """One ``rollout.backend``: how its engines are checked, started and described.

    Attributes:
        name: the value of ``rollout.backend``.
        start: :class:`EngineStart` -> a started pool: an object with ``client(**kw)`` (an
            ``SGLangClient`` for its servers), ``stop()`` and, when ``supervised``, ``supervise(...)``.
        check_config: refuses what this backend cannot run, from the config alone (part of
            ``config.validate``); raises ``ConfigError``.
        prepare: (cfg, engine_model, num_cpu_replicas, engine_threads) -> anything ``start`` needs,
            run before any data is read or process started; refuses what this host cannot serve.
        supervised: whether the pool restarts a dead engine (``pool.supervise``), and so the run
            survives an engine kill (``rollout.engine_restart``).
        describe: (cfg, plan) -> the engines' part of the start-up line.
    """

    name: str
    start: Callable[[EngineStart], Any]
    check_config: Optional[Callable[[Any], None]] = None
    prepare: Optional[Callable[[Any, Optional[str], int, Optional[int]], Any]] = None
    supervised: bool = False
    describe: Optional[Callable[[Any, Any], str]] = None


ENGINE_BACKENDS: Registry[EngineBackend] = Registry(
    "rollout.backend", "engine backend",
    {"embedded": "lightning_fasync.fleet.backends:EMBEDDED",
     "sglang": "lightning_fasync.fleet.backends:SGLANG",
     "vllm": "lightning_fasync.fleet.vllm:VLLM",
     "external": "lightning_fasync.fleet.backends:EXTERNAL"},
    hint=" (docs/backends.md)",
)


# --------------------------------------------------------------------------------------------
# Weight-sync paths (``rollout.weight_sync``, docs/weight_sync.md)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightPath:
    """One ``rollout.weight_sync`` path from the trainer to the engines.

    Attributes:
        name: the value of ``rollout.weight_sync``.
        make: (client, **kwargs) -> a :class:`~lightning_fasync.weights.sync.WeightSync` pushing
            over ``client`` (an ``SGLangClient``); kwargs are ``bucket_bytes``, ``timeout_s``,
            ``pause_mode`` and the path's own.
        client_method: what an engine client of your own (not an ``SGLangClient``) must have to
            receive the weights: ``client_method(tensors, weight_version=...)``.
        check_config: refuses what this path cannot do, from the config alone (part of
            ``config.validate``); raises ``ConfigError``.
        options: (the run's config, the policy the engines serve) -> the path's own keyword
            arguments of ``make`` (None: none).
    """

    name: str
    make: Callable[..., Any]
    client_method: str
    check_config: Optional[Callable[[Any], None]] = None
    options: Optional[Callable[[Any, Optional[str]], Mapping[str, Any]]] = None


WEIGHT_PATHS: Registry[WeightPath] = Registry(
    "rollout.weight_sync", "weight-sync path",
    {"distributed": "lightning_fasync.weights.group:DISTRIBUTED",
     "tensor": "lightning_fasync.weights.sync:TENSOR",
     "disk": "lightning_fasync.weights.sync:DISK",
     "vllm": "lightning_fasync.weights.vllm_sync:VLLM",
     "adapter": "lightning_fasync.weights.lora_sync:ADAPTER"},
    hint=" or auto (docs/weight_sync.md)",
)


def weight_sync_choices() -> list[str]:
    """The values ``rollout.weight_sync`` takes: ``auto`` and every registered path."""
    return ["auto", *WEIGHT_PATHS.names()]


# --------------------------------------------------------------------------------------------
# Trainer backends (docs/extending.md): what a strategy brings beyond Lightning's own
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerBackend:
    """One trainer backend: the strategy that selects it and what the package does differently under it.

    Attributes:
        name: the backend's name.
        strategy_names: how the command line and config files name its strategy
            (``--trainer.strategy=NAME``); the CLI then builds ``module_class``.
        strategy_class: ``"package.module:Class"`` of its Lightning strategy, imported by the CLI so
            that ``--trainer.strategy=Class`` resolves (None: Lightning's own, or registered by ``register``).
        register: called once by the CLI before parsing (e.g. Lightning ``StrategyRegistry`` entries).
        module_class: ``"package.module:Class"`` of the policy module the CLI builds under it (None:
            ``RLPolicyModule``).
        shard: (module, device_mesh) -> None: how ``RLPolicyModule.configure_model`` lays the policy
            out over the strategy's device mesh (None: the backend brings its own module).
        check_cli: the trainer's arguments (a dict of ``trainer.*``) -> refuses what this backend
            does not take, raising ``ConfigError``.
        is_checkpoint: path -> whether a checkpoint was written by this backend (its own layout).
        export: (ckpt_path, out, model, overwrite) -> the Hugging Face directory written from such
            a checkpoint (``lightning-fasync export``).
    """

    name: str
    strategy_names: Sequence[str] = ()
    strategy_class: Optional[str] = None
    register: Optional[Callable[[], None]] = None
    module_class: Optional[str] = None
    shard: Optional[Callable[[Any, Any], None]] = None
    check_cli: Optional[Callable[[Mapping[str, Any]], None]] = None
    is_checkpoint: Optional[Callable[[str], bool]] = None
    export: Optional[Callable[[str, str, Optional[str], bool], str]] = None


TRAINERS: Registry[TrainerBackend] = Registry(
    "trainer.strategy", "trainer backend",
    {"fsdp2": "lightning_fasync.trainers.fsdp:BACKEND",
     "megatron": "lightning_fasync.trainers.megatron:BACKEND"},
    hint=" (docs/extending.md)",
)


def trainer_backend_named(name: Optional[str]) -> Optional[TrainerBackend]:
    """The registered backend whose strategy the command line names ``name`` (None: none does)."""
    if name is None:
        return None
    for backend in TRAINERS.entries():
        if name in backend.strategy_names:
            return backend
    return None


def load_path(path: str) -> Any:
    """The object a ``"package.module:Name"`` path names."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


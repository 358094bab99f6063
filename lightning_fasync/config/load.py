"""The one parser: every command (fit, simulate, serve's engine flags aside) and every dict config
goes through jsonargparse built from the dataclasses of :mod:`~lightning_fasync.config.schema`,
whose field docstrings are the docs.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from dataclasses import asdict, fields, is_dataclass
from functools import lru_cache
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from lightning_fasync.config.schema import GROUPS, SCALARS, DataSourceConfig, FasyncConfig, RolloutConfig, TrainerConfig
from lightning_fasync.errors import ConfigError

__all__ = [
    "field_docs",
    "add_config_arguments",
    "config_parser",
    "config_from_namespace",
    "load_config",
    "load_config_file",
    "with_overrides",
]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (what ``--help`` shows)."""
    from docstring_parser import parse_from_object

    return {p.arg_name: p.description or "" for p in parse_from_object(cls).params}


def add_config_arguments(parser: Any, skip_trainer: Sequence[str] = ()) -> None:
    """Add the plugin's keys to a jsonargparse ``parser`` under the spec's names.

    Arguments:
        parser: a ``jsonargparse.ArgumentParser`` (LightningCLI's, or :func:`config_parser`'s).
        skip_trainer: ``trainer.*`` keys the parser already has (LightningCLI's ``trainer`` group
            holds Lightning's Trainer arguments; the RL keys are added into it one by one).
    """
    import typing

    docs = field_docs(FasyncConfig)
    for key, cls in GROUPS.items():
        if key == "trainer" and skip_trainer:
            hints, tdocs = typing.get_type_hints(TrainerConfig), field_docs(TrainerConfig)
            for f in fields(TrainerConfig):
                if f.name not in skip_trainer:
                    parser.add_argument(f"--trainer.{f.name}", type=hints[f.name], default=f.default, help=tdocs[f.name])
            continue
        parser.add_class_arguments(cls, key, help=docs[key])
        if key == "rollout":
            # jsonargparse cannot write dataclass instances nested in a dict back to YAML; a plain
            # dict default keeps a saved config.yaml reusable.
            parser.set_defaults({"rollout.sglang_replicas": {k: asdict(v) for k, v in RolloutConfig().sglang_replicas.items()}})
    parser.add_argument("--colocate", type=bool, default=True, help=docs["colocate"])
    parser.add_argument("--colocate_offload", type=Union[bool, Literal["auto"]], default="auto",
                        help=docs["colocate_offload"])
    parser.add_argument("--run_mode", type=str, default="default", help=docs["run_mode"])
    parser.add_argument("--data_sources", type=Optional[list[DataSourceConfig]], default=None, help=docs["data_sources"])


def config_parser(**sections: type) -> Any:
    """A parser of the plugin's keys plus extra dataclass ``sections`` (e.g. ``simulate=SimConfig``)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(exit_on_error=False, default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file of these keys.")
    add_config_arguments(parser)
    for key, cls in sections.items():
        parser.add_class_arguments(cls, key)
    return parser


def config_from_namespace(ns: Any, **sections: type) -> tuple["FasyncConfig", dict[str, Any]]:
    """The :class:`FasyncConfig` (and the extra ``sections``) of a parsed jsonargparse namespace."""
    values = _plain(ns)
    groups = {k: _dataclass(cls, values.get(k) or {}) for k, cls in GROUPS.items()}
    sources = values.get("data_sources")
    cfg = FasyncConfig(
        **groups,
        colocate=values.get("colocate", True),
        colocate_offload=values.get("colocate_offload", "auto"),
        run_mode=values.get("run_mode", "default"),
        data_sources=None if sources is None else [_dataclass(DataSourceConfig, s) for s in sources],
    )
    return cfg, {k: _dataclass(cls, values.get(k) or {}) for k, cls in sections.items()}


def load_config(data: Optional[Mapping[str, Any]] = None, **sections: type) -> Any:
    """The public builder: a validated-for-type :class:`FasyncConfig` from a nested dict (parsed
    YAML, a user's dict); unknown keys and mistyped values are refused naming the key.

    With ``sections`` (e.g. ``simulate=SimConfig``) returns ``(cfg, {name: section})``. Each call
    returns objects of its own: a dict parsed before is answered from a copy of its result (a plan
    builds each mode's config this way, dozens of times).
    """
    data = dict(data or {})
    key = _memo_key(data, sections)
    with _PARSE_LOCK:
        parsed = _PARSED.get(key) if key is not None else None
        if parsed is None:
            try:
                ns = _shared_parser(_section_key(sections)).parse_object(data)
            except Exception as exc:  # jsonargparse's ArgumentError
                raise ConfigError(_config_error_sentence(exc)) from None
            parsed = config_from_namespace(ns, **sections)
            if key is not None:
                _PARSED[key] = parsed
                while len(_PARSED) > _PARSED_MAX:
                    _PARSED.popitem(last=False)
        else:
            _PARSED.move_to_end(key)
        cfg, extra = copy.deepcopy(parsed)
    return (cfg, extra) if sections else cfg


# One parser per set of extra sections, built once (building one takes about as long as a parse),
# and the results of the last dicts parsed; parses take turns (a parser is not meant to be shared
# by threads mid-parse).
_PARSE_LOCK = threading.Lock()
_PARSED: "OrderedDict[str, tuple[FasyncConfig, dict[str, Any]]]" = OrderedDict()
_PARSED_MAX = 64


@lru_cache(maxsize=8)
def _shared_parser(sections: tuple[tuple[str, type], ...]) -> Any:
    return config_parser(**dict(sections))


def _section_key(sections: Mapping[str, type]) -> tuple[tuple[str, type], ...]:
    return tuple(sorted(sections.items(), key=lambda kv: kv[0]))


def _memo_key(data: Mapping[str, Any], sections: Mapping[str, type]) -> Optional[str]:
    """The dict and the sections as one string; None where the dict holds something JSON does not
    write as itself, or names a config file (whose contents may change between calls)."""
    if "config" in data:
        return None
    try:
        body = json.dumps(data, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError):
        return None
    return repr([(name, f"{cls.__module__}.{cls.__qualname__}") for name, cls in _section_key(sections)]) + body


def load_config_file(path: str, overrides: Sequence[str] = (), **sections: type) -> tuple["FasyncConfig", dict[str, Any]]:
    """Read a YAML config and command-line style ``overrides`` (``--fully_async.stale_steps=2``)."""
    import os

    if not os.path.exists(path):
        raise ConfigError(f"`--config` is {path!r}, which does not exist.")
    with _PARSE_LOCK:
        try:
            ns = _shared_parser(_section_key(sections)).parse_args(["--config", path, *overrides])
        except Exception as exc:
            raise ConfigError(_config_error_sentence(exc)) from None
        return config_from_namespace(ns, **sections)


def with_overrides(cfg: "FasyncConfig", overrides: Mapping[str, Any]) -> "FasyncConfig":
    """A copy of ``cfg`` with dotted-key ``overrides`` (``{"fully_async.stale_steps": 2.0}``) applied."""
    data = cfg.to_dict()
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"`{dotted}` is not a configuration key.")
            node = node[part]
        node[parts[-1]] = value
    return load_config(data)


def _dataclass(cls: type, value: Any) -> Any:
    if isinstance(value, cls):
        return value
    kwargs = {}
    hints = _type_hints(cls)
    for f in fields(cls):
        if f.name in value:
            kwargs[f.name] = _typed(hints[f.name], value[f.name])
    return cls(**kwargs)


def _typed(tp: Any, value: Any) -> Any:
    import typing

    if is_dataclass(tp) and isinstance(value, Mapping):
        return _dataclass(tp, value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union and value is not None:
        return _typed(next(a for a in args if a is not type(None)), value)
    if origin is dict and isinstance(value, Mapping):
        return {k: _typed(args[1], v) for k, v in value.items()}
    if origin is list and isinstance(value, (list, tuple)):
        return [_typed(args[0], v) for v in value]
    return value


def _type_hints(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


def _plain(obj: Any) -> Any:
    """jsonargparse namespaces and tuples → plain dicts and lists; dataclasses stay."""
    if hasattr(obj, "as_dict"):
        obj = obj.as_dict()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if not k.startswith("__") and k != "config"}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _config_error_sentence(exc: BaseException) -> str:
    """jsonargparse's message as the project's one sentence naming the key."""
    import re

    text = " ".join(str(exc).split())
    m = re.search(r"Group '([\w.]+)' does not accept (?:nested key|option) '([\w.]+)'", text)
    if m:
        group, key = m.groups()
        cls = GROUPS.get(group.split(".")[0])
        known = f"; the keys under `{group}` are: {', '.join(f.name for f in fields(cls))}" if cls and "." not in group else ""
        return f"`{group}.{key}` is not a configuration key{known}."
    m = re.search(r'[Kk]ey "([\w.\[\]]+)": Does not validate against any of the Union subtypes Subtypes: \[(.*?)\] '
                  r'Errors:.*Given value: (.*)$', text)
    if m:
        key, kinds, got = m.groups()
        # "<class 'bool'>, typing.Literal['auto']" -> "true or false, 'auto'"
        kinds = re.sub(r"typing\.Literal\[(.*?)\]", r"\1", kinds.replace("<class 'bool'>", "true or false"))
        return f"`{key}` is {got.strip()!r}; it must be one of: {kinds}."
    m = re.search(r"^Option '([\w.]+)' is not accepted", text)
    if m:
        top = sorted([*GROUPS, *SCALARS])
        return f"`{m.group(1)}` is not a configuration key; the top-level keys are: {', '.join(top)}."
    m = re.search(r'[Kk]ey "([\w.\[\]]+)": Expected a <class \'(\w+)\'>\. Got value: (.*)$', text)
    if m:
        key, kind, got = m.groups()
        kinds = {"float": "a number", "int": "an integer", "bool": "true or false", "str": "a string"}
        return f"`{key}` must be {kinds.get(kind, kind)}, got {got.strip()!r}."
    m = re.search(r"[Kk]ey \"([\w.\[\]]+)\": (.*)$", text)
    if m:
        return f"`{m.group(1)}`: {m.group(2)}"
    return text

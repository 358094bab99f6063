"""The one loader of user components named in the config as ``module:attribute``.

Rollout-side components (datasource, reward, agent flow, group filter) and window-strategy plugins
are objects the runtime receives; a config names them as ``package.module:Name`` and this module
imports and builds them, the way torchtune's ``config.instantiate`` does. A wrong entry is refused
with a sentence that names the config key.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Optional

from lightning_fasync.config import ConfigError

__all__ = ["ComponentError", "load_object", "instantiate"]


class ComponentError(ConfigError):
    """A ``module:attribute`` config entry that cannot be imported or built."""


def load_object(path: str, key: str) -> Any:
    """Import the object that ``path`` (``module:attribute``, attribute may be dotted) names.

    Arguments:
        path: ``package.module:Name``.
        key: the config key that holds ``path`` (for the error message).

    Raises:
        ComponentError: when ``path`` is malformed, cannot be imported, or is not callable.
    """
    module, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module or not attr:
        raise ComponentError(f"`{key}` is {path!r}; it must have the form package.module:Name.")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ComponentError(f"`{key}` is {path!r}, which cannot be imported: {exc}.") from exc
    if not callable(obj):
        raise ComponentError(f"`{key}` is {path!r}, which is not callable.")
    return obj


def instantiate(path: str, key: str, args: Optional[Mapping[str, Any]] = None, **injected: Any) -> Any:
    """Build ``path``'s class (or call its factory) with ``injected`` objects and the user's ``args``.

    ``injected`` are what the runtime hands every component of this kind (an engine client, the
    tokenizer); ``args`` are the user's keyword arguments from the config. A clash between them, or
    a signature that does not take them, is refused naming ``key``.
    """
    factory = load_object(path, key)
    args = dict(args or {})
    clash = sorted(set(args) & set(injected))
    if clash:
        raise ComponentError(f"`{key}` arguments set {', '.join(clash)}, which the runtime passes itself.")
    try:
        return factory(**injected, **args)
    except TypeError as exc:
        raise ComponentError(f"`{key}` ({path}) could not be built with arguments {sorted({**injected, **args})}: {exc}.") from exc

"""The errors every module may raise and every caller may catch; this module imports nothing.

- :class:`ConfigError`: a configuration (or an argument standing for one) the spec forbids, found
  before anything starts. The message is one sentence: the key, the value given, the rule.
- :class:`ConfigWarning`: a configuration the spec allows but recommends against.
- :class:`PipelineError`: the pipeline cannot go on (a timeout, a dead thread, an exhausted
  datasource).
"""

from __future__ import annotations

__all__ = ["ConfigError", "ConfigWarning", "PipelineError"]


class ConfigError(ValueError):
    """A configuration the spec forbids. The message is one sentence: key, value, rule."""


class ConfigWarning(UserWarning):
    """A configuration the spec allows but recommends against."""


class PipelineError(RuntimeError):
    """The pipeline cannot go on: a timeout, a dead thread, an exhausted datasource."""

"""The configuration: ``schema`` (the typed groups with the spec's names and a docstring per field),
``load`` (the one parser: YAML, dicts and command lines), ``validate`` (every rule, before
anything starts). Everything is importable from here: ``from lightning_fasync.config import
FasyncConfig, load_config, validate``.
"""

from lightning_fasync.config.load import *  # noqa: F401,F403
from lightning_fasync.config.load import _config_error_sentence  # noqa: F401 - the CLI words jsonargparse's errors
from lightning_fasync.config.schema import *  # noqa: F401,F403
from lightning_fasync.config.validate import *  # noqa: F401,F403
from lightning_fasync.errors import ConfigError, ConfigWarning  # noqa: F401

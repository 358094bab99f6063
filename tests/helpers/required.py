"""Optional packages some tests need. Where one is missing its tests skip, except under the flag that
``scripts/test`` sets for each (``LFA_REQUIRE_SGLANG=1`` and the like), where they fail: CI cannot pass
with them skipped."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import pytest


def located(module: str, flag: str, install: str) -> Optional[str]:
    """The directory of ``module``'s package, found without importing it (a dotted name imports its
    parents), or None where it is not installed; under ``flag=1`` a missing package fails instead."""
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent of a dotted name is missing
        spec = None
    if spec is not None:
        return os.path.dirname(spec.origin) if spec.origin else (list(spec.submodule_search_locations or []) or [""])[0]
    if os.environ.get(flag) == "1":
        pytest.fail(f"{module} is not installed, and {flag}=1 ({install} installs it).", pytrace=False)
    return None


def require(module: str, flag: str, install: str, module_level: bool = False) -> str:
    """:func:`located`, skipping the test (or, with ``module_level``, the module) where it is missing."""
    where = located(module, flag, install)
    if where is None:
        pytest.skip(f"{module} is not installed ({install})", allow_module_level=module_level)
    return where


SGLANG = ("sglang", "LFA_REQUIRE_SGLANG", "tests/requirements-sglang.txt")
MEGATRON = ("megatron.core", "LFA_REQUIRE_MEGATRON", "tests/requirements-megatron.txt")
RAY = ("ray", "LFA_REQUIRE_RAY", "tests/requirements-ray.txt")
TASKS = ("datasets", "LFA_REQUIRE_TASKS", "the `tasks` extra")

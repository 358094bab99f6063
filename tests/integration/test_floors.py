"""Dependency floors: every requirement in pyproject.toml has a ``>=`` floor that
``scripts/test-floors`` pins with ``==``, and under that script the installed versions are exactly
those floors (so its run really tests the floors, not whatever a reused venv holds)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers.paths import REPO


def _exact(line: str) -> tuple[str, Version]:
    req = Requirement(line)
    (spec,) = req.specifier
    assert spec.operator == "==", line
    return req.name, Version(spec.version)


def test_every_dependency_has_a_floor_to_pin():
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "test-floors"), "--print-pins"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pins = dict(_exact(line) for line in proc.stdout.split())
    assert {"torch", "lightning", "transformers", "jsonargparse", "pytest"} <= set(pins)
    assert pins["torch"] >= Version("2.6")  # torch.nn.utils.get_total_norm
    assert pins["transformers"] >= Version("4.56")  # from_config(dtype=)


@pytest.mark.skipif(not os.environ.get("LFA_FLOORS_PINS"), reason="runs under scripts/test-floors")
def test_installed_versions_are_the_floors():
    assert sys.version_info >= (3, 10)
    for line in os.environ["LFA_FLOORS_PINS"].split():
        name, floor = _exact(line)
        assert Version(version(name)) == floor, f"{name} {version(name)} is installed, the floor is {floor}"

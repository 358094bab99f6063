"""The CPU rehearsal's stand-in for the GPU image (scripts/gpu-rehearsal puts this folder on PYTHONPATH).

Blocks the import of every installed distribution that the image does not have
(``../packages.txt``) and the GPU check does not carry (``../requirements.txt``), in this process
and, through the environment, in every Python process it starts: a stage that would need one fails
here as it would there. Active only while ``FASYNC_IMAGE_PACKAGES`` names that folder.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import re
import sys


def _names(path: str) -> set[str]:
    out = set()
    with open(path) as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if line:
                out.add(re.sub(r"[-_.]+", "-", re.split(r"[=<>!~\[ ;]", line, 1)[0]).lower())
    return out


class _ImageOnly(importlib.abc.MetaPathFinder):
    """Finds nothing for a blocked top-level name, so that it reads as not installed: ``import``
    raises ModuleNotFoundError and ``importlib.util.find_spec`` answers None (how libraries probe
    their optional dependencies); every other name goes to the finder it wraps."""

    def __init__(self, inner, blocked: dict[str, str]) -> None:
        self.inner, self.blocked = inner, blocked

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.blocked:
            return None
        return self.inner.find_spec(fullname, path, target)

    def __getattr__(self, name):  # invalidate_caches, find_distributions, ...
        return getattr(self.inner, name)


def _install() -> None:
    folder = os.environ.get("FASYNC_IMAGE_PACKAGES")
    if not folder:
        return
    allowed = _names(os.path.join(folder, "packages.txt")) | _names(os.path.join(folder, "requirements.txt"))
    allowed.add("lightning-fasync")  # the checkout itself
    blocked: dict[str, str] = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        names = {re.sub(r"[-_.]+", "-", d).lower() for d in dists}
        if not names & allowed and top.isidentifier() and top not in sys.stdlib_module_names:
            blocked[top] = " / ".join(sorted(names))
    sys.meta_path[:] = [_ImageOnly(f, blocked) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    os.environ["FASYNC_IMAGE_BLOCKED"] = ",".join(sorted(blocked))  # what the preflight reports


_install()

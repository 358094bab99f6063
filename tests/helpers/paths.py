"""Where things are, for tests at any depth under ``tests/``."""

from __future__ import annotations

import os

HELPERS = os.path.dirname(os.path.abspath(__file__))  # tests/helpers: drivers and by-name modules
TESTS = os.path.dirname(HELPERS)
REPO = os.path.dirname(TESTS)
FIXTURES = os.path.join(TESTS, "fixtures")  # small data files (configs/ names them by path too)
FAKE_SGLANG = os.path.join(HELPERS, "fake_sglang")  # the FAKE ``sglang`` package, for rollout.backend: sglang

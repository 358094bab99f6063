"""benchmarks/packing.py's machinery on a few recorded calls (its tables and raw file); no timing is
asserted."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers.paths import REPO


@pytest.mark.slow
def test_packing_benchmark_smoke(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import packing
    finally:
        sys.path.pop(0)
    calls = [[[6, r] for r in (1, 3, 8, 2, 5, 1, 4, 6)] * 4, [[6, r] for r in (10, 2, 1, 1, 3, 2, 7, 1)] * 4]
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({"command": "recorded", "steps": 1, "calls": calls,
                                   "response_length": {"mean": 3.5, "median": 2.5, "max": 10, "min": 1}}))
    packing.main(["--quick", "--out", str(tmp_path), "--lengths", str(lengths)])
    text = (tmp_path / "packing.md").read_text()
    assert "## main job" in text and "## 16x longer tails" in text and "load average" in text
    for forward in ("padded", "packed", "packed-one-row", "packed-micro"):
        assert f"| {forward} |" in text
    raw = json.loads((tmp_path / "packing.json").read_text())
    main_job = raw["workloads"]["main job"]
    assert main_job["tokens"] < main_job["padded_tokens"]  # the calls have padding to save
    assert all(len(s) == 1 and s[0] > 0 for s in main_job["seconds"].values())

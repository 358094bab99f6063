"""The prepared GPU check (``benchmarks/gpu_check.py``) runs end to end: its CPU smoke mode drives the
same steps (weight sync over the tensor and disk paths, engine throughput against HF) with the
tiny model and writes the summary it prints. No timing is asserted."""

import os
import sys

import pytest

from tests.helpers.paths import REPO


@pytest.mark.slow
def test_gpu_check_script_runs_on_cpu(tmp_path, capsys):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary in capsys.readouterr().out
    assert "weight sync `tensor`" in summary and "weight sync `disk`" in summary
    assert "engine over HTTP, 4 x 8 tokens" in summary and "HF generate" in summary
    assert {"weight_sync.log", "engine_throughput.log"} <= set(os.listdir(tmp_path))

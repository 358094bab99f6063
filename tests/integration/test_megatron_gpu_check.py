"""The prepared megatron-core GPU check (``benchmarks/gpu_megatron_check.py``) runs end to end in its
CPU smoke mode: tiny Qwen3 model, logits against HF, exact export, training steps with a falling
loss, the summary table printed last. No timing is asserted."""

import subprocess
import sys

import pytest

from tests.helpers.megatron_cpu import require_megatron
from tests.helpers.paths import REPO

require_megatron()



@pytest.mark.slow
def test_gpu_megatron_check_runs_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_megatron_check.py", "--device", "cpu", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert proc.stdout.rstrip().endswith(summary.rstrip())
    rows = {line.split(" | ")[0].lstrip("| "): line for line in summary.splitlines()[2:]}
    assert "| ok |" in rows["logits vs HF"] and "| ok |" in rows["export Megatron -> HF"]
    assert "ok: loss" in rows["train step, megatron-core (2 x 32 tokens)"]
    assert "skipped on CPU" in rows["RL steps via MegatronStrategy + embedded engine (tensor sync)"]

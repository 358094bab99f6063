"""``benchmarks/lora.py`` runs (a short run on ``tiny``: its tables and files). No timing is asserted."""

import json
import os
import sys

import pytest

from tests.helpers.paths import REPO


@pytest.mark.slow
def test_the_lora_benchmark_smoke(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import lora as bench
    finally:
        sys.path.pop(0)
    assert bench.main(["--model", "tiny", "--r", "4", "--alpha", "8", "--rounds", "1", "--steps", "1", "--batch", "1",
                       "--seq", "16", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "lora.md").read_text()
    assert "| merged |" in text and "| adapter |" in text and "| full |" in text and "| lora |" in text
    assert "load average" in text
    result = json.loads((tmp_path / "results.json").read_text())
    push, train = result["push"], result["train"]
    # Bytes are counted, not timed: the adapter is a small share of the merged model.
    assert 0 < push["adapter"]["bytes"] < push["merged"]["bytes"]
    assert train["lora"]["trainable_params"] < train["full"]["trainable_params"]
    assert train["lora"]["params_grads_optimizer_mib"] < train["full"]["params_grads_optimizer_mib"]

"""Benchmarks are not tests; this only checks that the parity benchmark's machinery runs (one
2-step run per mode, the per-run metrics, the summary and the picture). No timing is asserted."""

import math
import os
import sys

import pytest

from tests.helpers.paths import REPO


@pytest.mark.slow
def test_parity_benchmark_smoke(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import parity
    finally:
        sys.path.pop(0)
    modes = dict(parity.MODES)
    runs = [parity.run_one(name, modes[name], 1, 2, str(tmp_path), []) for name in ("colocate", "fully-async, in-flight updates")]
    for run in runs:
        rewards = [v for _, v in run["reward"]]
        assert len(rewards) == 2 and all(math.isfinite(v) for v in rewards)
        assert len(run["timing_step"]) == 2
        assert run["proc_wall_s"] > 0
    assert sum(runs[1]["lag_hist"].values()) > 0, "the fully-async run's ledger gave no consumed-group lags"

    rows, summary = parity.summarize(runs)
    assert [r["mode"] for r in rows] == ["colocate", "fully-async, in-flight updates"]
    for r in rows:
        for key in ("seed", "steps", "final_reward", "mid_reward", "t_to_0.3", "t_to_target", "t_to_0.5",
                    "mean_step_s", "wall_clock_s", "proc_wall_s", "version_lag_mean", "ledger_lag_mean", "lag_hist"):
            assert key in r
        assert r["steps"] == 2 and math.isfinite(r["final_reward"])
    assert set(summary["modes"]) == {"colocate", "fully-async, in-flight updates"}
    assert summary["target"] is not None and len(summary["verdict"]) == 4
    assert "| **colocate** |" in parity.parity_markdown(rows, summary)

    png = parity.plot(runs, str(tmp_path / "parity.png"), summary["target"])
    assert os.path.getsize(png) > 10_000

    raw = tmp_path / "raw.json"
    parity.save_raw(runs[1], str(raw))
    assert parity.load_raw(str(raw))["lag_hist"] == runs[1]["lag_hist"]

"""Benchmarks are not tests; this only checks that the speedup benchmark's machinery runs
(two short modes, table, timeline picture in PNG and in TensorBoard). No timing is asserted."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_speedup_benchmark_smoke(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import speedup
    finally:
        sys.path.pop(0)
    modes = dict(speedup.MODES)
    rows = [speedup.run_mode(name, modes[name], 2, str(tmp_path), []) for name in ("colocate", "fully_async (windowed-fifo, stale = 1.0)")]
    text = speedup.table(rows, bound=1.5)
    assert "| colocate |" in text and "| fully_async (windowed-fifo, stale = 1.0) |" in text
    assert rows[0]["pipeline_buf_size"] is None and rows[1]["pipeline_buf_size"] is not None
    for r in rows:
        assert os.path.getsize(r["timeline"]) > 10_000
        assert r["rollout_s"] >= 0 and r["train_s"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    import glob

    log_dir = glob.glob(os.path.join(tmp_path, "colocate", "lightning_logs", "version_*"))[0]
    images = []
    for f in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        acc = EventAccumulator(f)
        acc.Reload()
        images += acc.Tags()["images"]
    assert "timeline" in images


@pytest.mark.slow
def test_weight_sync_benchmark_smoke(tmp_path):
    """``benchmarks/weight_sync.py --quick``: every path timed against the copy, the files written."""
    import csv
    import json

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import weight_sync
    finally:
        sys.path.pop(0)
    rows = weight_sync.main(["--quick", "--out", str(tmp_path)])
    assert [r["path"] for r in rows] == ["distributed", "tensor", "disk"]
    assert all(r["model"] == "tiny" and r["push_s"] > 0 and r["gb_s"] > 0 and r["copy_gb_s"] > 0 for r in rows)
    # Each path against its own medium: a memory copy, a gloo broadcast to a second process, a file.
    assert [r["medium"] for r in rows] == ["gloo broadcast", "memory copy", "file write + read"]
    assert all(r["medium_gb_s"] > 0 and r["ratio"] == pytest.approx(r["gb_s"] / r["medium_gb_s"], abs=0.01) for r in rows)
    with open(tmp_path / "results.csv") as f:
        assert [r["path"] for r in csv.DictReader(f)] == ["distributed", "tensor", "disk"]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert {"nproc", "cpu", "loadavg_before", "loadavg_after", "date", "git_commit"} <= set(meta)
    assert "| tiny |" in (tmp_path / "results.md").read_text()

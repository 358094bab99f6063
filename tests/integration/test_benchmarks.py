"""Benchmarks are not tests; these only check that the benchmarks' machinery runs (short runs, their
tables and files). No timing is asserted."""

import glob
import os
import sys

import pytest

from tests.helpers.paths import REPO


def test_speedup_oversample_sets_colocate_plus_partials_over_dispatch_only():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import speedup
    finally:
        sys.path.pop(0)
    modes = dict(speedup.select_modes(["colocate-partial", "fully-async-abort-and-resume"], 16))
    assert list(modes) == ["colocate", "colocate + partial", "fully-async, abort and resume"]
    assert [o for o in modes["colocate + partial"] if "num_oversample" in o] == ["--rollout.sampler.num_oversample=16"]
    assert not any("num_oversample" in o for name in ("colocate", "fully-async, abort and resume") for o in modes[name])
    frozen = dict(speedup.select_modes(["colocate-partial-tail-frozen"], 16))["colocate + partial, tail frozen"]
    assert [o for o in frozen if "num_oversample" in o] == ["--rollout.sampler.num_oversample=16"]
    assert "--rollout.weight_update_mode=inflight" in frozen
    default = dict(speedup.select_modes(None))["colocate + partial"]
    assert f"--rollout.sampler.num_oversample={speedup.B // 4}" in default
    with pytest.raises(SystemExit, match="--oversample is -1"):
        speedup.select_modes(None, -1)


@pytest.mark.slow
def test_speedup_benchmark_smoke(tmp_path, monkeypatch):
    """Colocate and the default fully-async config, 3 steps, one round: the tables, the per-run CSV
    and raw files, the timelines, and a bound that is a bound (share of bound <= 100 %)."""
    import csv
    import json

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import speedup
    finally:
        sys.path.pop(0)
    runs_dir = tmp_path / "runs"
    os.makedirs(runs_dir)
    monkeypatch.setattr(speedup.tempfile, "mkdtemp", lambda prefix="": str(runs_dir))  # keep the run directories
    monkeypatch.setattr(speedup.shutil, "rmtree", lambda *a, **k: None)
    speedup.main(["--steps", "3", "--rounds", "1", "--modes", "fully-async-abort-and-resume", "--out", str(tmp_path)])
    text = (tmp_path / "speedup.md").read_text()
    assert "| colocate |" in text and "| fully-async, abort and resume |" in text and "load average" in text
    with open(tmp_path / "runs.csv") as f:
        runs = {r["mode"]: r for r in csv.DictReader(f)}
    fa = runs["fully-async, abort and resume"]
    assert float(fa["speedup"]) > 0 and float(fa["bound"]) > 0
    assert float(fa["share"]) <= 1.0 + 1e-9  # the run's own floor: trainer work and CPU time per core
    assert float(fa["engine_cpu"]) > 0 and float(fa["trainer_cpu"]) > 0
    assert runs["colocate"]["bound"] == ""  # no fully-async bound for colocate itself
    # Per consumed token: colocate is its own baseline, and the mode's ratio is its tokens/s over colocate's.
    assert float(runs["colocate"]["tokens_speedup"]) == 1.0 and float(fa["resp_len"]) > 0
    assert float(fa["tokens_speedup"]) == pytest.approx(float(fa["tokens_per_s"]) / float(runs["colocate"]["tokens_per_s"]),
                                                         rel=1e-3)
    raw = json.loads((tmp_path / "raw" / "fully-async-abort-and-resume-0.json").read_text())
    assert len(raw["step"]) == 3 and raw["cpu_steady"]["engine"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in ("colocate", "fully-async-abort-and-resume"):
        assert os.path.getsize(tmp_path / f"timeline-{name}.png") > 10_000
        images = []
        for f in glob.glob(str(runs_dir / f"{name}-0" / "lightning_logs" / "version_*" / "events.out.tfevents.*")):
            acc = EventAccumulator(f)
            acc.Reload()
            images += acc.Tags()["images"]
        assert "timeline" in images  # also in the run's TensorBoard
    again = tmp_path / "again"
    os.makedirs(again / "raw")
    for f in os.listdir(tmp_path / "raw"):
        (again / "raw" / f).write_text((tmp_path / "raw" / f).read_text())
    (again / "meta.json").write_text((tmp_path / "meta.json").read_text())
    speedup.main(["--from-raw", str(again)])
    assert (again / "speedup.md").read_text() == text


@pytest.mark.slow
def test_weight_sync_benchmark_smoke(tmp_path):
    """``benchmarks/weight_sync.py --quick``: every path timed against the copy, the files written;
    the sharded section: a 2-rank FSDP2 trainer's push against this process's, over ``tensor`` and
    ``distributed``, with the same weights, resident memory, and rank 0's peak set against its bound."""
    import csv
    import json

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import weight_sync
    finally:
        sys.path.pop(0)
    result = weight_sync.main(["--quick", "--out", str(tmp_path)])
    rows, sharded = result["paths"], result["sharded"]
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

    assert [(r["path"], r["trainer"]) for r in sharded] == [
        ("tensor", "single process"), ("tensor", weight_sync.SHARDED),
        ("distributed", "single process"), ("distributed", weight_sync.SHARDED)]
    for single, shard in (sharded[0:2], sharded[2:4]):
        assert single["push_s"] > 0 and shard["push_s"] > 0 and single["rss_mb"] > 0
        assert shard["same_weights"] is True  # the ranks' gathered tensors hash as this process's do
        assert 0 < shard["gather_s"] <= shard["push_s"] and 0 < shard["gather_share"] <= 1
        assert shard["rss_mb"] > 0 and shard["rss1_mb"] > 0
        # The first push allocates rank 0's staging bucket: its peak extra cannot be zero.
        assert shard["peak_extra_mb"] > 0 and shard["peak_extra1_mb"] >= 0 and shard["held_mb"] >= 0
        assert shard["bucket_max_mb"] > 0 and shard["largest_tensor_mb"] > 0
        assert shard["bound_mb"] == pytest.approx(shard["bucket_max_mb"] + shard["largest_tensor_mb"], abs=0.02)
        assert shard["peak_over_bound"] == pytest.approx(shard["peak_extra_mb"] / shard["bound_mb"], rel=0.05)
    with open(tmp_path / "sharded.csv") as f:
        assert [r["trainer"] for r in csv.DictReader(f)] == ["single process", weight_sync.SHARDED] * 2
    assert meta["sharded"]["paths"] == ["tensor", "distributed"] and meta["sharded"]["world"] == 2
    text = (tmp_path / "results.md").read_text()
    assert "## Sharded trainer" in text and f"| tiny | float32 | tensor | {weight_sync.SHARDED} |" in text

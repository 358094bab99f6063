"""The GPU check's one command (``scripts/gpu-check`` -> ``benchmarks/gpu_all.py``, docs/gpu.md).

- The CPU rehearsal (``scripts/gpu-rehearsal``: the GPU image's package set enforced, its
  transformers installed over ours, the carried wheels installed the way the GPU machine installs
  them) runs every stage to ``ok`` and leaves what the GPU machine sends back: at most 8 files, no
  more than 2 folders down.
- ``--budget-s`` is honoured: stages that cannot get their minimum are skipped with a row saying so.
- A stage that fails or raises keeps the other stages' rows, and fails the run.
- The package blocker makes a package the image lacks read as not installed.
- The command in docs/gpu.md is the one the rehearsal runs.

No timing is asserted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import gpu_all  # noqa: E402

sys.path.pop(0)

SITE = os.path.join(REPO, "benchmarks", "gpu_image", "site")


def _files(root: str) -> list[str]:
    return [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs]


def test_docs_give_the_command_the_rehearsal_runs():
    def commands(path: str) -> list[str]:
        with open(os.path.join(REPO, path)) as fh:
            return [line.strip() for line in fh if line.strip().startswith("./scripts/gpu-check ")]

    rehearsal = commands("scripts/gpu-rehearsal")
    assert len(rehearsal) == 1, rehearsal
    assert rehearsal[0].endswith(' "$@"')
    assert rehearsal[0].removesuffix(' "$@"') in commands("docs/gpu.md")


def test_blocked_packages_read_as_not_installed():
    """With the blocker on, a package the venv has and the image lacks (``datasets``) is neither
    found nor importable; torch (on the image) and jsonargparse (carried) import."""
    code = ("import importlib.util, sys\n"
            "assert importlib.util.find_spec('datasets') is None\n"
            "try:\n    import datasets\nexcept ModuleNotFoundError as e:\n    print('blocked', e.name)\n"
            "import torch, jsonargparse\nprint('ok')\n")
    env = {**os.environ, "FASYNC_IMAGE_PACKAGES": os.path.dirname(SITE), "PYTHONPATH": SITE}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["blocked", "datasets", "ok"]
    # Without the variable nothing is blocked (the test's premise: datasets is installed here).
    env.pop("FASYNC_IMAGE_PACKAGES")
    proc = subprocess.run([sys.executable, "-c", "import datasets"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_tiny_budget_skips_stages_with_a_row_saying_so(tmp_path):
    code = gpu_all.main(["--budget-s", "3", "--out", str(tmp_path)])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["check"]: r for r in summary["rows"]}
    assert set(rows) == {s.name for s in gpu_all.STAGES}
    for row in rows.values():
        assert row["status"] == "skipped"
        # A stage whose imports are missing here (megatron.core where it is not installed) says that first.
        assert (re.fullmatch(r"-?\d+ s of the budget left, the stage needs \d+ s", row["detail"])
                or re.fullmatch(r"missing [\w.]+(, [\w.]+)* \(.+\)", row["detail"])), row["detail"]
    assert any("of the budget left" in row["detail"] for row in rows.values())
    assert summary["wall_s"] < 60  # the budget stopped it: not one stage started


def test_a_failing_stage_keeps_the_others(tmp_path, monkeypatch):
    def ok(ctx, timeout):
        return [gpu_all.Row("fine", "1.0 s")]

    def boom(ctx, timeout):
        raise KeyError("results.csv")

    def bad(ctx, timeout):
        return [gpu_all.failed("broken", 3, "bad")]

    monkeypatch.setattr(gpu_all, "preflight", lambda ctx, timeout: {"python": "3", "modules": {}})
    monkeypatch.setattr(gpu_all, "STAGES", [gpu_all.Stage("a", ok, 0, 10), gpu_all.Stage("b", boom, 0, 10),
                                            gpu_all.Stage("c", bad, 0, 10), gpu_all.Stage("d", ok, 0, 10)])
    assert gpu_all.main(["--budget-s", "120", "--out", str(tmp_path), "--device", "cpu"]) == 1
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert [(r["check"], r["status"]) for r in rows] == [("fine", "ok"), ("b", "FAILED"), ("broken", "FAILED"),
                                                         ("fine", "ok")]
    assert "KeyError" in rows[1]["detail"]


@pytest.mark.slow
def test_the_cpu_rehearsal_runs_every_stage(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["./scripts/gpu-rehearsal", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu"
    pre = summary["preflight"]["modules"]
    # The image's versions where the rehearsal installs them, and the carried wheels importable.
    assert pre["transformers"]["version"] == "5.17.0" and pre["tokenizers"]["version"] == "0.23.2"
    assert pre["megatron.core"]["ok"] and pre["jsonargparse"]["ok"]
    stages = {r["check"].split(":")[0].split(" ")[0] for r in summary["rows"]}
    assert {r["status"] for r in summary["rows"]} == {"ok"}, summary["rows"]
    assert {"main", "embedded", "weight", "megatron"} <= stages
    checks = " ".join(r["check"] for r in summary["rows"])
    for needle in ("fully-async fit", "HF generate", "weight sync `tensor`", "weight sync `disk`", "colocate_offload",
                   "megatron: logits vs HF", "megatron: export"):
        assert needle in checks, needle
    files = _files(str(out))
    assert len(files) <= 8 and all(f.count(os.sep) <= 2 for f in files), files
    assert {"summary.md", "summary.json"} <= set(files)
    assert proc.stdout.rstrip().endswith((out / "summary.md").read_text().rstrip())

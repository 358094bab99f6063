"""How well ``lightning-fasync plan`` predicts the live tables (benchmarks/speedup.py).

For each workload, ``plan`` profiles the config (its two short runs and the engine curves) and
predicts every mode's steady-state speedup over colocate; the live speedups are read from the
committed ``speedup.csv`` of the same workload (run ``benchmarks/speedup.py`` first, on the same
kind of machine). Each workload is predicted twice: with the profile's own response lengths (what a
user gets from a first look) and with the lengths of a whole colocate run of the config
(``--lengths_from`` its ledger: a learning policy's lengths change after the profile's first steps).

    python benchmarks/plan_accuracy.py          # both workloads, ~10 minutes on 2 cores

Written to ``--out`` (default ``benchmarks/results/plan/``): ``accuracy.md`` (machine record and
tables), ``<workload>-profile/`` and ``<workload>-full/`` (each plan's ``plan.md`` and ``plan.json``).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _machine import check_load, header, record  # noqa: E402

WORKLOADS = {
    "main-job": ("configs/tiny_cpu.yaml", "benchmarks/results/speedup/speedup.csv", []),
    "long-tail": ("configs/tiny_cpu_longtail.yaml", "benchmarks/results/speedup_longtail/speedup.csv",
                  ["--trainer.rollout_steps=80"]),
}


def live_speedups(path: str) -> dict[str, tuple[float, float, float]]:
    """Mode -> (median, min, max) steady-state speedup from a speedup.csv."""
    out = {}
    with open(os.path.join(REPO, path)) as fh:
        for row in csv.DictReader(fh):
            if row.get("speedup_median"):
                out[row["mode"]] = (float(row["speedup_median"]), float(row["speedup_min"]), float(row["speedup_max"]))
    return out


def full_run_ledger(config: str, extra: list[str], tmp: str) -> str:
    """A whole colocate run of ``config``: its ledger (every consumed group's response lengths)."""
    root = os.path.join(tmp, "full")
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", config, *extra, "--colocate=true",
           "--fully_async.enable=false", "--rollout.partial=false", f"--trainer.default_root_dir={root}",
           "--trainer.enable_progress_bar=false", "--trainer.save_freq=0"]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    (ledger,) = glob.glob(os.path.join(root, "lightning_logs", "version_*", "ledger.jsonl"))
    return ledger


def run_plan(config: str, extra: list[str], out: str, lengths: Optional[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "plan", "--config", config, "--out", out, *extra]
    if lengths:
        cmd += ["--lengths_from", lengths]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    with open(os.path.join(out, "plan.json")) as fh:
        return json.load(fh)


def table(name: str, live: dict[str, tuple[float, float, float]], plans: dict[str, dict[str, Any]]) -> str:
    kinds = list(plans)
    head = "| mode | live speedup, median (range) | " + " | ".join(f"predicted ({k}) | error ({k})" for k in kinds) + " |"
    lines = [f"### {name}", "", head, "|" + "---|" * (2 + 2 * len(kinds))]
    errors: dict[str, list[float]] = {k: [] for k in kinds}
    for mode, (med, lo, hi) in live.items():
        cells = []
        for k in kinds:
            row = next((r for r in plans[k]["rows"] if r["config"] == mode), None)
            if row is None:
                cells += ["-", "-"]
                continue
            err = row["speedup_excl0"] / med - 1.0
            errors[k].append(abs(err))
            cells += [f"{row['speedup_excl0']:.2f}x", f"{err:+.0%}"]
        lines.append(f"| {mode} | {med:.2f}x ({lo:.2f}-{hi:.2f}) | " + " | ".join(cells) + " |")
    for k in kinds:
        e = errors[k]
        if e:
            within = sum(1 for x in e if x <= 0.10)
            lines.append(f"\n{k}: {within} of {len(e)} modes within ±10 %; largest error {max(e):.0%}.")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "plan"))
    args = parser.parse_args(argv)
    info = {**record(), "command": "python benchmarks/plan_accuracy.py" + (f" {' '.join(argv)}" if argv else "")}
    warning = check_load(info)
    t0 = time.perf_counter()
    sections = []
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        for name in args.workloads:
            config, live_csv, extra = WORKLOADS[name]
            live = live_speedups(live_csv)
            plans = {"profile lengths": run_plan(config, extra, os.path.join(args.out, f"{name}-profile"), None)}
            ledger = full_run_ledger(config, extra, os.path.join(tmp, name))
            plans["a whole run's lengths"] = run_plan(config, extra, os.path.join(args.out, f"{name}-full"), ledger)
            sections.append(table(f"{name} ({config}; live: {live_csv})", live, plans))
            print(sections[-1], flush=True)
    info["load_after"] = os.getloadavg()
    text = header("plan against the live tables", info, time.perf_counter() - t0, warning) + "\n" + "\n\n".join(sections)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "accuracy.md"), "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()

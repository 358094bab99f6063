"""How well ``lightning-fasync plan`` predicts the live tables (benchmarks/speedup.py).

For each workload, ``plan`` profiles the config (its two short runs and the engine curves) and
predicts every mode's steady-state speedup over colocate (the median over its seeds, their range in
brackets); the live speedups are read from the
committed ``speedup.csv`` of the same workload (run ``benchmarks/speedup.py`` first, on the same
kind of machine). Each workload is predicted twice: with the profile's own response lengths (what a
user gets from a first look) and with the lengths of a whole colocate run of the config, replayed in
the order that run consumed them (``--lengths_from`` its ledger: a learning policy's lengths change
after the profile's first steps), from the same profile (``--profile_from``), so the two differ by
the lengths alone.

    python benchmarks/plan_accuracy.py          # every workload, ~25 minutes on 2 cores

Written to ``--out`` (default ``benchmarks/results/plan/``): ``accuracy.md`` (machine record and
tables; ``accuracy-<workload>.md`` when ``--workloads`` names a subset), ``<workload>-profile/`` and
``<workload>-full/`` (each plan's ``plan.md`` and ``plan.json``).
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

from lightning_fasync.plan import speedup_cell  # noqa: E402

# name: (config, live table, fit overrides of its live runs, plan's own options: the live table's
# colocate + partial over-dispatch). A plan is set against a live table of the same machine: the
# main job's, long-tail-kept's and long-tail-amd's are the 2-core AMD EPYC's, long-tail's and
# long-tail-fixed's the 2-core Intel Xeon's (their accuracy files say which profile they were set against).
WORKLOADS = {
    "main-job": ("configs/tiny_cpu.yaml", "benchmarks/results/speedup_main_amd/speedup.csv", [], []),
    # The main job's two modes that missed by most, again with 5 rounds, beside colocate (AMD EPYC).
    "main-job-recheck": ("configs/tiny_cpu.yaml", "benchmarks/results/speedup_main_recheck/speedup.csv", [], []),
    "long-tail": ("configs/tiny_cpu_longtail.yaml", "benchmarks/results/speedup_longtail/speedup.csv",
                  ["--trainer.rollout_steps=80"], ["--oversample", "16"]),
    "long-tail-fixed": ("configs/tiny_cpu_longtail_fixed.yaml", "benchmarks/results/speedup_longtail_fixed_rerun/speedup.csv",
                        ["--trainer.rollout_steps=40"], ["--oversample", "16"]),
    # The same workload's table with the aborted requests' caches kept (rollout.resume_kv: keep).
    "long-tail-kept": ("configs/tiny_cpu_longtail_fixed.yaml", "benchmarks/results/speedup_longtail_kept/speedup.csv",
                       ["--trainer.rollout_steps=40"], ["--oversample", "16"]),
    # Every mode of the spec's table on the same workload, the caches kept or not (AMD EPYC).
    "long-tail-amd": ("configs/tiny_cpu_longtail_fixed.yaml", "benchmarks/results/speedup_longtail_amd/speedup.csv",
                      ["--trainer.rollout_steps=40"], ["--oversample", "16"]),
}


def live_speedups(path: str) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Mode -> {"step": (median, min, max) steady-state speedup, "tokens": the same in consumed
    tokens/s, when the table has it} from a speedup.csv."""
    out = {}
    with open(os.path.join(REPO, path)) as fh:
        for row in csv.DictReader(fh):
            if row.get("speedup_median"):
                out[row["mode"]] = {k: (float(row[f"{col}_median"]), float(row[f"{col}_min"]), float(row[f"{col}_max"]))
                                    for k, col in (("step", "speedup"), ("tokens", "tokens_speedup"))
                                    if row.get(f"{col}_median")}
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


def run_plan(config: str, extra: list[str], out: str, lengths: Optional[str], plan_args: list[str],
             profile_from: Optional[str] = None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "plan", "--config", config, "--out", out, *plan_args, *extra]
    if lengths:
        cmd += ["--lengths_from", lengths]
    if profile_from:
        cmd += ["--profile_from", profile_from]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    with open(os.path.join(out, "plan.json")) as fh:
        return json.load(fh)


def hide_tmp(out: str, tmp: str) -> None:
    """The plan names the ledger it drew lengths from; that run's temporary directory means nothing
    elsewhere, so the written plan calls it ``<temporary colocate run>``."""
    for f in ("plan.md", "plan.json"):
        path = os.path.join(out, f)
        with open(path) as fh:
            text = fh.read()
        with open(path, "w") as fh:
            fh.write(text.replace(tmp, "<temporary colocate run>"))


def table(name: str, live: dict[str, dict[str, tuple[float, float, float]]], plans: dict[str, dict[str, Any]]) -> str:
    """Each mode's predicted speedup against the live one per step and, where the live table has it,
    per consumed token (the plan draws every mode's lengths from one set; live runs each have their own)."""
    kinds = list(plans)
    bases = [b for b in ("step", "tokens") if any(b in v for v in live.values())]
    label = {"step": "per step", "tokens": "in consumed tokens/s"}
    short = {"step": "step", "tokens": "tokens/s"}
    head = ("| mode | " + " | ".join(f"live speedup {label[b]}, median (range)" for b in bases) + " | "
            + " | ".join(f"predicted ({k}) | " + " | ".join(f"error vs {short[b]} ({k})" for b in bases)
                         for k in kinds) + " |")
    lines = [f"### {name}", "", head, "|" + "---|" * (1 + len(bases) + len(kinds) * (1 + len(bases)))]
    errors: dict[tuple[str, str], list[float]] = {(k, b): [] for k in kinds for b in bases}
    inside: dict[tuple[str, str], int] = {(k, b): 0 for k in kinds for b in bases}  # within the rounds' range
    for mode, figs in live.items():
        cells = [f"{figs[b][0]:.2f}x ({figs[b][1]:.2f}-{figs[b][2]:.2f})" if b in figs else "-" for b in bases]
        for k in kinds:
            row = next((r for r in plans[k]["rows"] if r["config"] == mode), None)
            if row is None:
                cells += ["-"] * (1 + len(bases))
                continue
            cells.append(speedup_cell(row))
            for b in bases:
                if b not in figs:
                    cells.append("-")
                    continue
                err = row["speedup_excl0"] / figs[b][0] - 1.0
                errors[(k, b)].append(abs(err))
                inside[(k, b)] += figs[b][1] <= row["speedup_excl0"] <= figs[b][2]
                cells.append(f"{err:+.0%}")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    for (k, b), e in errors.items():
        if e:
            within = sum(1 for x in e if x <= 0.10)
            lines.append(f"\n{k}, against the live speedup {label[b]}: {within} of {len(e)} modes within ±10 %; "
                         f"largest error {max(e):.0%}; {inside[(k, b)]} of {len(e)} inside the live range of rounds.")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "plan"))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    info = {**record(), "command": "python benchmarks/plan_accuracy.py" + (f" {' '.join(argv)}" if argv else "")}
    warning = check_load(info)
    t0 = time.perf_counter()
    sections = []
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        for name in args.workloads:
            config, live_csv, extra, plan_args = WORKLOADS[name]
            live = live_speedups(live_csv)
            plans = {"profile lengths": run_plan(config, extra, os.path.join(args.out, f"{name}-profile"), None, plan_args)}
            ledger = full_run_ledger(config, extra, os.path.join(tmp, name))
            # The same profile, other lengths: the two predictions differ by the lengths alone.
            plans["a whole run's lengths"] = run_plan(config, extra, os.path.join(args.out, f"{name}-full"), ledger,
                                                      plan_args, os.path.relpath(os.path.join(args.out, f"{name}-profile",
                                                                                              "plan.json"), REPO))
            hide_tmp(os.path.join(args.out, f"{name}-full"), tmp)
            sections.append(table(f"{name} ({config}; live: {live_csv})", live, plans))
            print(sections[-1], flush=True)
    info["load_after"] = os.getloadavg()
    text = header("plan against the live tables", info, time.perf_counter() - t0, warning) + "\n" + "\n\n".join(sections)
    os.makedirs(args.out, exist_ok=True)
    # Every workload: accuracy.md; a subset (re-measured after its live table changed): accuracy-<names>.md.
    name = "accuracy.md" if set(args.workloads) == set(WORKLOADS) else f"accuracy-{'-'.join(args.workloads)}.md"
    with open(os.path.join(args.out, name), "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()

"""Learning parity: does fully-async learn as well as colocate, per step and per second?

Runs the embedded default (`configs/tiny_cpu.yaml`) through `lightning-fasync fit` in four modes,
several seeds each, one run at a time and interleaved by seed (colocate s1, fully-async s1,
colocate s2, ...) so that a drift in the machine's load touches both modes alike:

- colocate: `--colocate=true --fully_async.enable=false --rollout.partial=false`;
- fully-async, abort and resume: the config as it stands (windowed-fifo, stale_steps 0, partial
  rollout, IS correction), its boundary named (`--rollout.weight_update_mode=abort`);
- fully-async, in-flight updates and boundary waits: the same with the other two boundaries
  (`--rollout.weight_update_mode=inflight`; `--rollout.partial=false --rollout.weight_update_mode=wait`).

Each run is seeded with `--seed_everything=SEED --data_source.seed=SEED`. From each run's
TensorBoard scalars it takes `rollout/reward_mean`, `timing/step` (wall-clock = their cumulative
sum; the process's own wall time is recorded too) and `train/version_lag_mean`; from its ledger
(`ledger.jsonl`) the lag of every consumed group (consumption step - start_version) as a histogram.

Per run: the final reward (mean of the last 10 steps), the reward at the middle of the run (the 10
steps around it: 55-64 of 120), the wall-clock until the 10-step trailing mean reward first reaches
0.3, the target T (the median over colocate seeds of their final reward) and 0.5, the mean step
time and the mean version lag. Per mode: median and range over seeds, and a verdict (is
fully-async's median final reward inside colocate's seed range; median time to T per mode and its
ratio). Written: `<out>/parity.md`, `<out>/parity.csv`, `<out>/parity.meta.json` (the machine
record, for `--from-raw`), `<out>/raw/<mode>-<seed>.json` (only the scalars used, plus the load
average around the run; the run directories live in a temporary directory and are deleted) and the picture
(`--png`): reward (10-step trailing mean) against step and against wall-clock, a thin line per
seed and a thick median line per mode.

`--sweep` adds the staleness sweep: fully-async at stale_steps 0, 1, 2, 4, each with no
correction, IS, M2PO and OPSM, written to `<out>/sweep.md`, `<out>/sweep.csv`, `<out>/sweep.meta.json`
and `<out>/raw/sweep-*.json`.

    python benchmarks/parity.py                                   # 2 modes x 3 seeds x 120 steps
    python benchmarks/parity.py --sweep                           # plus the 16-variant sweep
    python benchmarks/parity.py --sweep --skip-parity             # the sweep alone
    python benchmarks/parity.py --from-raw benchmarks/results/parity   # tables and picture again
    python benchmarks/parity.py --steps 2 --seeds 1 --out /tmp/p --png /tmp/p.png   # smoke check

Arguments it does not know (or everything after `--extra`) are appended to every `fit` command.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lightning_fasync.pipeline.events import read_jsonl  # noqa: E402
from lightning_fasync.plots import read_scalars  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import check_load, header  # noqa: E402
from _machine import record as machine  # noqa: E402

BASELINE = "colocate"
MODES: list[tuple[str, list[str]]] = [
    ("colocate", ["--colocate=true", "--fully_async.enable=false", "--rollout.partial=false"]),
    ("fully-async, in-flight updates", ["--rollout.weight_update_mode=inflight"]),
    ("fully-async, abort and resume", ["--rollout.weight_update_mode=abort"]),
    ("fully-async, boundary waits", ["--rollout.partial=false", "--rollout.weight_update_mode=wait"]),
]
STALE_STEPS = (0, 1, 2, 4)
CORRECTIONS: list[tuple[str, list[str]]] = [
    ("none", ["--algorithm.is_correction.enable=false"]),
    ("IS", ["--algorithm.is_correction.enable=true"]),
    ("M2PO", ["--algorithm.is_correction.enable=false", "--algorithm.m2po.enable=true"]),
    ("OPSM", ["--algorithm.is_correction.enable=false", "--algorithm.opsm.enable=true"]),
]
WINDOW = 10  # steps: the final / middle reward windows and the trailing mean
THRESHOLDS = (0.3, 0.5)  # fixed reward levels for the time-to-reward columns (besides the target T)
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def slug(name: str) -> str:
    return re.sub(r"-+", "-", "".join(c if c.isalnum() else "-" for c in name)).strip("-").lower()


# ---------------------------------------------------------------------------------------- one run


RUN_TIMEOUT_S = 1800  # one fit run; the default's 120 steps take about 1.5 minutes on 2 cores


def fit_command(overrides: list[str], seed: int, steps: int, root: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
            f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false", "--trainer.save_freq=0",
            f"--trainer.rollout_steps={steps}", f"--seed_everything={seed}", f"--data_source.seed={seed}",
            *overrides, *extra]


def ledger_lags(path: str) -> dict[int, int]:
    """Histogram of consumption step - start_version over the ledger's consumed groups."""
    hist: dict[int, int] = {}
    if not os.path.exists(path):
        return hist
    for rec in read_jsonl(path):
        if rec.get("kind") != "consume" or rec.get("start_version") is None or rec.get("step") is None:
            continue
        lag = int(rec["step"]) - int(rec["start_version"])
        hist[lag] = hist.get(lag, 0) + 1
    return dict(sorted(hist.items()))


def run_one(mode_name: str, overrides: list[str], seed: int, steps: int, root: str, extra: list[str]) -> dict[str, Any]:
    """Run `fit` once under ``root/<mode-slug>-<seed>`` and return only what the tables and the
    picture use (the run directory is left for the caller to delete)."""
    run_root = os.path.join(root, f"{slug(mode_name)}-{seed}")
    cmd = fit_command(overrides, seed, steps, run_root, extra)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{mode_name} seed {seed} did not finish within {RUN_TIMEOUT_S} s: {shlex.join(cmd)}") from None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{mode_name} seed {seed} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    log_dir = sorted(glob.glob(os.path.join(run_root, "lightning_logs", "version_*")))[-1]
    tb = read_scalars(log_dir)
    pairs = lambda tag: [[int(s), float(v)] for s, v in tb.get(tag, [])]  # noqa: E731
    return {
        "mode": mode_name,
        "seed": seed,
        "steps": steps,
        "overrides": overrides,
        "extra": list(extra),
        "reward": pairs("rollout/reward_mean"),
        "timing_step": pairs("timing/step"),
        "version_lag_mean": pairs("train/version_lag_mean"),
        "lag_hist": ledger_lags(os.path.join(log_dir, "ledger.jsonl")),
        "proc_wall_s": wall,
        "run_dir": run_root,
    }


def save_raw(run: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keep = {k: v for k, v in run.items() if k != "run_dir"}
    keep["lag_hist"] = {str(k): v for k, v in run["lag_hist"].items()}
    with open(path, "w") as fh:
        json.dump(keep, fh, indent=1)


def load_raw(path: str) -> dict[str, Any]:
    with open(path) as fh:
        run = json.load(fh)
    run["lag_hist"] = {int(k): v for k, v in run["lag_hist"].items()}
    return run


# ---------------------------------------------------------------------------------------- metrics


def trailing(values: list[float], k: int = WINDOW) -> list[float]:
    """Trailing mean over up to ``k`` values (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def curves(run: dict[str, Any]) -> tuple[list[int], list[float], list[float]]:
    """(steps, rewards, wall-clock seconds at the end of each of those steps)."""
    steps = [s for s, _ in run["reward"]]
    rewards = [v for _, v in run["reward"]]
    cum, t = {}, 0.0
    for s, v in run["timing_step"]:
        t += v
        cum[s] = t
    last = 0.0
    wall = []
    for s in steps:
        last = cum.get(s, last)
        wall.append(last)
    return steps, rewards, wall


def time_to(rewards: list[float], wall: list[float], level: float, k: int = WINDOW) -> Optional[float]:
    """Wall-clock at the first step whose full ``k``-step trailing mean reward is >= ``level``."""
    for i in range(k - 1, len(rewards)):
        if statistics.fmean(rewards[i - k + 1 : i + 1]) >= level:
            return wall[i]
    return None


def mid_window(n: int, k: int = WINDOW) -> tuple[int, int]:
    """Index range [a, b) of the ``k`` steps around the middle of ``n`` (55..64 of 120)."""
    a = max(0, n // 2 - k // 2)
    return a, min(n, a + k)


def finite_mean(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x == x and not math.isinf(x)]
    return statistics.fmean(xs) if xs else None


def run_metrics(run: dict[str, Any]) -> dict[str, Any]:
    steps, rewards, wall = curves(run)
    n = len(rewards)
    a, b = mid_window(n)
    hist = run["lag_hist"]
    total = sum(hist.values())
    times = [v for _, v in run["timing_step"]]
    return {
        "mode": run["mode"],
        "seed": run["seed"],
        "steps": n,
        "final_reward": statistics.fmean(rewards[-WINDOW:]) if rewards else None,
        "mid_reward": statistics.fmean(rewards[a:b]) if rewards else None,
        "mid_window": f"{steps[a]}-{steps[b - 1]}" if rewards else "",
        **{f"t_to_{lvl}": time_to(rewards, wall, lvl) for lvl in THRESHOLDS},
        "mean_step_s": statistics.fmean(times) if times else None,
        "wall_clock_s": sum(times),
        "proc_wall_s": run["proc_wall_s"],
        "version_lag_mean": finite_mean([v for _, v in run["version_lag_mean"]]),
        "ledger_lag_mean": sum(k * c for k, c in hist.items()) / total if total else None,
        "lag_hist": " ".join(f"{k}:{c}" for k, c in hist.items()),
    }


def spread(values: list[Optional[float]]) -> dict[str, Any]:
    """Median, min, max over seeds; None (never reached) counts as +inf."""
    xs = [math.inf if v is None else v for v in values]
    if not xs:
        return {}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "finite": sum(1 for x in xs if math.isfinite(x))}


NUMERIC = ["final_reward", "mid_reward", *(f"t_to_{lvl}" for lvl in THRESHOLDS), "t_to_target", "mean_step_s",
           "wall_clock_s", "proc_wall_s", "version_lag_mean", "ledger_lag_mean"]


def summarize(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-run metric rows and a summary: target T, per-mode median/min/max, lag histograms, verdict."""
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    base = BASELINE if BASELINE in modes else modes[0]
    rows = []
    for run in runs:
        row = run_metrics(run)
        row["_run"] = run
        rows.append(row)
    base_finals = [r["final_reward"] for r in rows if r["mode"] == base and r["final_reward"] is not None]
    target = statistics.median(base_finals) if base_finals else None
    for row in rows:
        _, rewards, wall = curves(row.pop("_run"))
        row["t_to_target"] = time_to(rewards, wall, target) if target is not None else None
    per_mode: dict[str, dict[str, Any]] = {}
    lag_hists: dict[str, dict[int, int]] = {}
    for m in modes:
        mr = [r for r in rows if r["mode"] == m]
        per_mode[m] = {k: spread([r[k] for r in mr]) for k in NUMERIC if any(r[k] is not None for r in mr) or k.startswith("t_to")}
        h: dict[int, int] = {}
        for run in runs:
            if run["mode"] == m:
                for k, c in run["lag_hist"].items():
                    h[k] = h.get(k, 0) + c
        lag_hists[m] = dict(sorted(h.items()))
    verdict = []
    if base in per_mode and "final_reward" in per_mode[base]:
        lo, hi = per_mode[base]["final_reward"]["min"], per_mode[base]["final_reward"]["max"]
        t_base = per_mode[base]["t_to_target"]["median"]
        verdict.append(f"Target T = median {base} final reward = {fmt(target)}; {base} seed range [{fmt(lo)}, {fmt(hi)}].")
        verdict.append(f"Median wall-clock to T: {base} {fmt_s(t_base)}.")
        for m in modes:
            if m == base or "final_reward" not in per_mode[m]:
                continue
            med = per_mode[m]["final_reward"]["median"]
            inside = lo <= med <= hi
            verdict.append(f"(1) {m}: median final reward {fmt(med)} is {'inside' if inside else 'OUTSIDE'} "
                           f"{base}'s seed range [{fmt(lo)}, {fmt(hi)}] -> {'parity held' if inside else 'parity not shown'}.")
            t_m = per_mode[m]["t_to_target"]["median"]
            ratio = t_base / t_m if math.isfinite(t_base) and math.isfinite(t_m) and t_m > 0 else None
            verdict.append(f"(2) {m}: median wall-clock to T {fmt_s(t_m)} against {base} {fmt_s(t_base)}; "
                           f"ratio {base} / {m} = {'n/a' if ratio is None else f'{ratio:.2f}x'}.")
    return rows, {"baseline": base, "target": target, "modes": per_mode, "lag_hists": lag_hists, "verdict": verdict}


# ---------------------------------------------------------------------------------------- tables


def fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "never" if math.isinf(v) else f"{v:.{nd}f}"
    return str(v)


def fmt_s(v: Optional[float]) -> str:
    return "-" if v is None else ("never" if math.isinf(v) else f"{v:.0f} s")


def fmt_spread(s: dict[str, Any], nd: int = 3) -> str:
    if not s:
        return "-"
    some = 0 < s["finite"] < s["n"]  # some seeds reached a level, some never did
    return f"{fmt(s['median'], nd)} ({fmt(s['min'], nd)}-{fmt(s['max'], nd)})" + (f", {s['finite']}/{s['n']} reached" if some else "")


def lag_text(hist: dict[int, int]) -> str:
    total = sum(hist.values())
    if not total:
        return "(no ledger lags)"
    return ", ".join(f"lag {k}: {c / total:.1%} ({c})" for k, c in hist.items())


PARITY_COLS = [("mode", "mode", None), ("seed", "seed", None), ("steps", "steps", None),
               ("final_reward", "final reward (last 10)", 3), ("mid_reward", "mid reward", 3), ("mid_window", "mid steps", None),
               ("t_to_0.3", "t to 0.3 (s)", 0), ("t_to_target", "t to T (s)", 0), ("t_to_0.5", "t to 0.5 (s)", 0),
               ("mean_step_s", "mean step (s)", 2), ("wall_clock_s", "sum of steps (s)", 0), ("proc_wall_s", "process (s)", 0),
               ("version_lag_mean", "version lag (TB)", 2), ("ledger_lag_mean", "lag (ledger)", 2)]


def parity_markdown(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    cols = PARITY_COLS
    out = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r[k], nd) if nd is not None else fmt(r[k]) for k, _, nd in cols) + " |")
    for m, s in summary["modes"].items():
        cells = []
        for k, _, nd in cols:
            if k == "mode":
                cells.append(f"**{m}**")
            elif k == "seed":
                cells.append(f"median (min-max), {sum(1 for r in rows if r['mode'] == m)} seeds")
            elif k in s:
                cells.append(fmt_spread(s[k], nd))
            else:
                cells.append("")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def write_csv(path: str, rows: list[dict[str, Any]], keys: list[str]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in keys})


def parity_csv(path: str, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    keys = [k for k, _, _ in PARITY_COLS] + ["lag_hist"]
    out = list(rows)
    for m, s in summary["modes"].items():
        for stat in ("median", "min", "max"):
            out.append({"mode": m, "seed": stat, **{k: v[stat] for k, v in s.items()}})
    write_csv(path, out, keys)


# ---------------------------------------------------------------------------------------- picture


def plot(runs: list[dict[str, Any]], png: str, target: Optional[float] = None) -> str:
    """Reward (10-step trailing mean) against rollout step and against wall-clock: a thin line per
    seed, a thick median line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = list(dict.fromkeys(r["mode"] for r in runs))
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=120, sharey=True)
    for i, m in enumerate(modes):
        color = COLORS[i % len(COLORS)]
        mr = [r for r in runs if r["mode"] == m]
        by_step: dict[int, list[float]] = {}
        series = []
        for r in mr:
            steps, rewards, wall = curves(r)
            sm = trailing(rewards)
            if not steps:
                continue
            ax_s.plot(steps, sm, color=color, linewidth=0.8, alpha=0.35)
            ax_t.plot(wall, sm, color=color, linewidth=0.8, alpha=0.35)
            for s, v in zip(steps, sm):
                by_step.setdefault(s, []).append(v)
            series.append((np.asarray(wall), np.asarray(sm)))
        n = len(series)
        xs = sorted(s for s, v in by_step.items() if len(v) == n)
        ax_s.plot(xs, [statistics.median(by_step[s]) for s in xs], color=color, linewidth=2.5,
                  label=f"{m} (median of {n} seed{'s' if n != 1 else ''})")
        if series:
            # Median over seeds on a common time grid, up to the shortest run's end (all seeds present).
            t_end = min(w[-1] for w, _ in series)
            t_start = max(w[0] for w, _ in series)
            grid = np.linspace(t_start, t_end, 200) if t_end > t_start else np.asarray([t_end])
            med = np.median(np.vstack([np.interp(grid, w, v) for w, v in series]), axis=0)
            ax_t.plot(grid, med, color=color, linewidth=2.5, label=m)
    for ax in (ax_s, ax_t):
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    if target is not None:
        ax_s.text(0.01, target, f" T = {target:.2f}", color="gray", va="bottom", fontsize=8, transform=ax_s.get_yaxis_transform())
    ax_s.set_xlabel("rollout step")
    ax_t.set_xlabel("wall-clock (s, cumulative timing/step)")
    ax_s.set_ylabel(f"reward ({WINDOW}-step trailing mean)")
    ax_s.set_title("reward against step")
    ax_t.set_title("reward against wall-clock")
    ax_s.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png


# ---------------------------------------------------------------------------------------- sweep


def sweep_variants(stales: list[float], corrections: list[str]) -> list[tuple[str, list[str], float, str]]:
    corr = dict(CORRECTIONS)
    out = []
    for s in stales:
        for c in corrections:
            name = f"stale={s:g} {c}"
            out.append((name, [f"--fully_async.stale_steps={float(s)}", *corr[c]], s, c))
    return out


def sweep_summarize(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    rows = []
    for run in runs:
        m = run_metrics(run)
        rows.append({"stale": run["stale"], "correction": run["correction"], **m})
    stales = list(dict.fromkeys(r["stale"] for r in rows))
    corrs = list(dict.fromkeys(r["correction"] for r in rows))
    lines = ["| stale_steps | " + " | ".join(corrs) + " |", "|" + "---|" * (len(corrs) + 1)]
    for s in stales:
        cells = []
        for c in corrs:
            vals = [r["final_reward"] for r in rows if r["stale"] == s and r["correction"] == c and r["final_reward"] is not None]
            if not vals:
                cells.append("-")
            elif len(vals) == 1:
                cells.append(fmt(vals[0]))
            else:
                cells.append(f"{fmt(statistics.median(vals))} ({fmt(min(vals))}-{fmt(max(vals))})")
        lines.append(f"| {s:g} | " + " | ".join(cells) + " |")
    return rows, "\n".join(lines)


SWEEP_COLS = [("stale", "stale_steps", None), ("correction", "correction", None), ("seed", "seed", None),
              ("final_reward", "final reward (last 10)", 3), ("mid_reward", "mid reward", 3), ("mid_window", "mid steps", None),
              ("ledger_lag_mean", "lag (ledger)", 2), ("version_lag_mean", "version lag (TB)", 2),
              ("mean_step_s", "mean step (s)", 2), ("lag_hist", "lag histogram (lag:groups)", None)]


def sweep_markdown(rows: list[dict[str, Any]], matrix: str) -> str:
    out = ["| " + " | ".join(h for _, h, _ in SWEEP_COLS) + " |", "|" + "---|" * len(SWEEP_COLS)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r[k], nd) if nd is not None else (f"{r[k]:g}" if k == "stale" else fmt(r[k]))
                                     for k, _, nd in SWEEP_COLS) + " |")
    return ("Final reward (mean of the last 10 steps; median and range when several seeds):\n\n" + matrix
            + "\n\nEvery run:\n\n" + "\n".join(out))


# ---------------------------------------------------------------------------------------- main


def execute(plan: list[tuple[str, list[str], int, dict[str, Any]]], steps: int, raw_dir: str, extra: list[str],
            reuse: bool, keep: bool) -> list[dict[str, Any]]:
    """Run ``plan`` ((name, overrides, seed, tags) each) one at a time; raw json saved as each ends."""
    runs = []
    tmp = tempfile.mkdtemp(prefix="parity-")
    try:
        for i, (name, overrides, seed, tags) in enumerate(plan):
            raw = os.path.join(raw_dir, f"{slug(name)}-{seed}.json")
            if reuse and os.path.exists(raw):
                print(f"[{i + 1}/{len(plan)}] {name} seed {seed}: reusing {os.path.relpath(raw)}", flush=True)
                runs.append({**load_raw(raw), **tags})
                continue
            print(f"[{i + 1}/{len(plan)}] {name} seed {seed} ...", end=" ", flush=True)
            load_before = os.getloadavg()
            run = run_one(name, overrides, seed, steps, tmp, extra)
            run.update(tags, load_before=load_before, load_after=os.getloadavg())
            save_raw(run, raw)
            if keep:
                print(f"(kept {run['run_dir']})", end=" ")
            else:
                shutil.rmtree(run["run_dir"], ignore_errors=True)
            m = run_metrics(run)
            print(f"{run['proc_wall_s']:.0f} s, final reward {fmt(m['final_reward'])}, lags {m['lag_hist'] or '-'}", flush=True)
            runs.append(run)
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return runs


def save_meta(path: str, info: dict[str, Any], wall: float, warning: Optional[str]) -> None:
    with open(path, "w") as fh:
        json.dump({**info, "wall_s": wall, "warning": warning}, fh, indent=1)


def regenerated(path: str, command: str) -> tuple[dict[str, Any], float, Optional[str]]:
    """The original run's header (from its meta file) with a line saying who rebuilt the tables."""
    now = datetime.now().astimezone().isoformat(timespec="seconds")
    if os.path.exists(path):
        with open(path) as fh:
            meta = json.load(fh)
        wall, warning = meta.pop("wall_s"), meta.pop("warning")
        note = f"tables regenerated from raw/ on {now} by `{command}`"
        return meta, wall, (f"{warning}; {note}" if warning else note)
    info = {**machine(), "command": "(unknown: no meta file)", "load_after": os.getloadavg()}
    return info, math.nan, f"tables regenerated from raw/ on {now} by `{command}`; the original run's machine record is missing"


def report_parity(runs: list[dict[str, Any]], out: str, png: Optional[str], info: dict[str, Any], wall: float,
                  warning: Optional[str]) -> None:
    rows, summary = summarize(runs)
    table = parity_markdown(rows, summary)
    lags = "\n".join(f"- {m}: {lag_text(h)}" for m, h in summary["lag_hists"].items())
    verdict = "\n".join(f"- {v}" for v in summary["verdict"])
    steps = sorted({r["steps"] for r in rows})
    body = (
        f"{len(runs)} runs of `configs/tiny_cpu.yaml`, {'/'.join(map(str, steps))} rollout steps each, one at a time, "
        f"interleaved by seed. Rewards are `rollout/reward_mean`; wall-clock is the cumulative `timing/step` "
        f"(startup excluded; `process` is the whole `fit` process). t to X: wall-clock at which the {WINDOW}-step "
        f"trailing mean reward first reaches X (T = median {summary['baseline']} final reward). Summary rows: "
        f"median (min-max) over seeds; `never` = not reached.\n\n{table}\n\n"
        f"Lag of consumed groups (ledger: consumption step - start_version), all seeds:\n\n{lags}\n\nVerdict:\n\n{verdict}\n"
    )
    if png:
        plot(runs, png, summary["target"])
        body += f"\n![reward against step and wall-clock]({os.path.relpath(png, out)})\n"
    text = header("Learning parity: colocate against fully-async", info, wall, warning) + "\n" + body
    print("\n" + body)
    with open(os.path.join(out, "parity.md"), "w") as fh:
        fh.write(text)
    parity_csv(os.path.join(out, "parity.csv"), rows, summary)


def report_sweep(runs: list[dict[str, Any]], out: str, info: dict[str, Any], wall: float, warning: Optional[str]) -> None:
    rows, matrix = sweep_summarize(runs)
    body = (f"Fully-async (`configs/tiny_cpu.yaml`), `fully_async.stale_steps` x correction "
            f"(none: IS off; IS; M2PO: IS off, M2PO on; OPSM: IS off, OPSM on), "
            f"{len(runs)} runs, one at a time.\n\n" + sweep_markdown(rows, matrix) + "\n")
    print("\n" + body)
    with open(os.path.join(out, "sweep.md"), "w") as fh:
        fh.write(header("Staleness sweep: which corrections keep reward as staleness grows", info, wall, warning) + "\n" + body)
    write_csv(os.path.join(out, "sweep.csv"), rows, [k for k, _, _ in SWEEP_COLS])


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 7, 99])
    parser.add_argument("--steps", type=int, default=120, help="rollout steps per run (the default config's length)")
    parser.add_argument("--modes", nargs="+", default=None, help=f"subset of: {', '.join(repr(n) for n, _ in MODES)} (or slugs)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "parity"))
    parser.add_argument("--png", default=os.path.join(REPO, "docs", "parity.png"))
    parser.add_argument("--sweep", action="store_true", help="also run the staleness x correction sweep")
    parser.add_argument("--skip-parity", action="store_true", help="run only the sweep")
    parser.add_argument("--sweep-seeds", type=int, nargs="+", default=[1234])
    parser.add_argument("--sweep-steps", type=int, default=120)
    parser.add_argument("--stale", type=float, nargs="+", default=list(STALE_STEPS), help="sweep's stale_steps values")
    parser.add_argument("--corrections", nargs="+", default=[c for c, _ in CORRECTIONS], choices=[c for c, _ in CORRECTIONS])
    parser.add_argument("--from-raw", metavar="DIR", help="no runs: rebuild tables and picture from DIR/raw/*.json")
    parser.add_argument("--reuse", action="store_true", help="skip runs whose raw json already exists under --out")
    parser.add_argument("--keep-runs", action="store_true", help="keep the temporary run directories (debugging)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="everything after it goes to every fit command")
    args, unknown = parser.parse_known_args(argv)
    extra = [*unknown, *args.extra]
    argv_shown = sys.argv[1:] if argv is None else argv
    command = "python benchmarks/parity.py" + (" " + shlex.join(argv_shown) if argv_shown else "")

    by_key = {**{n: (n, o) for n, o in MODES}, **{slug(n): (n, o) for n, o in MODES}}
    if args.modes:
        bad = [m for m in args.modes if m not in by_key]
        if bad:
            parser.error(f"unknown mode(s) {bad}; choose from {[n for n, _ in MODES]}")
    modes = [by_key[m] for m in args.modes] if args.modes else MODES

    if args.from_raw:
        raws = [load_raw(p) for p in sorted(glob.glob(os.path.join(args.from_raw, "raw", "*.json")))]
        par = [r for r in raws if "stale" not in r]
        order = {n: i for i, (n, _) in enumerate(MODES)}
        par.sort(key=lambda r: (order.get(r["mode"], 99), r["seed"]))
        if par:
            report_parity(par, args.from_raw, args.png, *regenerated(os.path.join(args.from_raw, "parity.meta.json"), command))
        sw = [r for r in raws if "stale" in r]
        if sw:
            sw.sort(key=lambda r: (r["stale"], [c for c, _ in CORRECTIONS].index(r["correction"]), r["seed"]))
            report_sweep(sw, args.from_raw, *regenerated(os.path.join(args.from_raw, "sweep.meta.json"), command))
        return

    os.makedirs(args.out, exist_ok=True)
    raw_dir = os.path.join(args.out, "raw")
    if not args.skip_parity:
        info = {**machine(), "command": command}
        warning = check_load(info)
        t0 = time.perf_counter()
        plan = [(name, ov, seed, {}) for seed in args.seeds for name, ov in modes]
        runs = execute(plan, args.steps, raw_dir, extra, args.reuse, args.keep_runs)
        info["load_after"] = os.getloadavg()
        save_meta(os.path.join(args.out, "parity.meta.json"), info, time.perf_counter() - t0, warning)
        report_parity(runs, args.out, args.png, info, time.perf_counter() - t0, warning)
    if args.sweep or args.skip_parity:
        info = {**machine(), "command": command}
        warning = check_load(info)
        t0 = time.perf_counter()
        variants = sweep_variants(args.stale, args.corrections)
        plan = [(f"sweep {name}", ov, seed, {"stale": s, "correction": c}) for seed in args.sweep_seeds for name, ov, s, c in variants]
        runs = execute(plan, args.sweep_steps, raw_dir, extra, args.reuse, args.keep_runs)
        info["load_after"] = os.getloadavg()
        save_meta(os.path.join(args.out, "sweep.meta.json"), info, time.perf_counter() - t0, warning)
        report_sweep(runs, args.out, info, time.perf_counter() - t0, warning)


if __name__ == "__main__":
    main()

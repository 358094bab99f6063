"""Fully-async against colocate on the embedded default, side by side (the spec's tables 5.2–5.4).

Runs the main job (`configs/tiny_cpu.yaml`: same seed, prompts and number of outer steps; by
default its whole 120-step run) through `lightning-fasync fit` once per mode and round, rounds
interleaved (round 1: every mode, then round 2, ...) so that a drift in the machine's load touches
every mode alike:

- colocate; colocate + partial (over-dispatch B/4 groups, or ``--oversample K``, abort the tail,
  resume it next step; again with the aborted requests' caches kept, ``rollout.resume_kv: keep``,
  and with the tail frozen instead): rollout, then training, each phase on every core;
- fully-async as configured (the default: windowed-fifo, stale 0; trainer and engine on disjoint
  halves of the cores, one torch thread per core);
- fully-async with shared cores: trainer and engine each on every core with as many threads (the
  operating system shares them; the engine's OpenMP workers sleep when idle);
- fully-async no-window, windowed-fifo, window-gated and staleness-bounded at stale 1.0, windowed-fifo
  at stale 2.0 (the spec's tables 5.3 and 5.4), and that last one with the caches kept;
- how the boundary treats the requests in flight: waits for them, or in-flight updates (KV kept or
  recomputed), beside the default abort-and-resume.

``--config`` picks the workload (the long-tailed one: ``configs/tiny_cpu_longtail.yaml``);
``--seed-per-round`` gives each round its own seed, so the rounds are also seeds of a learning
comparison (reward against wall-clock, and the wall-clock each mode takes to reach colocate's
final reward).

Per run: the mean step time excluding step 0 (steady state), the same over the run's first, middle
and last third (responses shorten as the policy learns, so the phases differ), the phase times
(the trainer's wait for data, its own work, its training calls) and the CPU seconds per step of the
trainer and of its engine processes (sampled from /proc). Per mode: the median and range over
rounds; the speedup is each round's colocate step over the mode's, median (range) over rounds.

The bound is computed from each fully-async run itself, at the thread counts each side actually
had: a step cannot be shorter than the trainer's own work in it (step minus its wait for data:
training calls, batch assembly, the step boundary), nor than the CPU time both sides spent on it
spread over every core. So ``bound = colocate step / max(trainer work, (trainer CPU + engine CPU) /
cores)``, and a share of bound above 100 % cannot happen. Beside it, labelled, the classic overlap
bound from colocate's two-thread phase times, (rollout + train) / max(rollout, train), which
assumes each side keeps its colocate speed on half the machine.

Written to `--out` (default `benchmarks/results/speedup/`): `speedup.md` (machine record, tables),
`speedup.csv` (per mode), `runs.csv` (per run), `raw/<mode>-<round>.json` and each mode's timeline
from its first round (`timeline-<mode>.png`, also logged to that run's TensorBoard). A load average
over 0.5 per core before the start is warned about in the output.

    python benchmarks/speedup.py                  # 3 rounds x 13 modes x 120 steps, ~60 minutes on 2 cores
    python benchmarks/speedup.py --config configs/tiny_cpu_longtail.yaml --steps 80 --seed-per-round 1 \
        --oversample 16 --out benchmarks/results/speedup_longtail  # the long-tailed workload, rounds as seeds
    python benchmarks/speedup.py --quick          # 20 steps, 1 round: a smoke check, ~3 minutes
    python benchmarks/speedup.py --from-raw benchmarks/results/speedup   # tables again from raw/

Arguments it does not know are appended to every `fit` command.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _machine import check_load, header, record  # noqa: E402
from parity import slug  # noqa: E402

from lightning_fasync.plots import log_image_to_tensorboard, plot_timeline, read_scalars  # noqa: E402

B = 16  # the configs' prompts per step (colocate + partial over-dispatches B // 4 groups unless --oversample)
N = 8  # the configs' trajectories per prompt (consumed tokens per step: B x N x mean response length)
DEFAULT_CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")
BASELINE = "colocate"
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
SHARED = [f"--trainer.strategy.init_args.trainer_cores=[{','.join(map(str, _CORES))}]",
          f"--trainer.strategy.init_args.rollout_cores=[{','.join(map(str, _CORES))}]"]
# The spec's experiments abort and resume at the boundary (rollout.partial: true); a config's
# weight_update_mode (auto reads in-flight updates there) must not change them, so their rows name abort.
ABORT = ["--rollout.weight_update_mode=abort"]
COLOCATE_PARTIAL = ["--colocate=true", "--fully_async.enable=false", "--rollout.partial=true",
                    f"--rollout.sampler.num_oversample={B // 4}"]
WINDOWED_FIFO_2 = ["--fully_async.sliding_window=windowed-fifo", "--fully_async.stale_steps=2.0", *ABORT]
KEEP = ["--rollout.resume_kv=keep"]  # aborted requests resumed from the caches they left: no prefill again
MODES: list[tuple[str, list[str]]] = [
    ("colocate", ["--colocate=true", "--fully_async.enable=false", "--rollout.partial=false"]),
    ("colocate + partial", COLOCATE_PARTIAL),
    ("colocate + partial, KV kept", COLOCATE_PARTIAL + KEEP),
    # The long tail frozen in the engines (KV kept) through training and the sync instead of aborted.
    ("colocate + partial, tail frozen", COLOCATE_PARTIAL + ["--rollout.weight_update_mode=inflight"]),
    ("fully-async, abort and resume", ABORT),
    ("fully-async, shared cores", SHARED + ABORT),
    ("fully-async no-window, stale 1.0", ["--fully_async.sliding_window=no-window", "--fully_async.stale_steps=1.0", *ABORT]),
    ("fully-async windowed-fifo, stale 1.0", ["--fully_async.sliding_window=windowed-fifo", "--fully_async.stale_steps=1.0",
                                              *ABORT]),
    ("fully-async windowed-fifo, stale 2.0", WINDOWED_FIFO_2),
    ("fully-async windowed-fifo, stale 2.0, KV kept", WINDOWED_FIFO_2 + KEEP),
    ("fully-async window-gated, stale 1.0", ["--fully_async.sliding_window=window-gated", "--fully_async.stale_steps=1.0",
                                             *ABORT]),
    ("fully-async staleness-bounded, stale 1.0", ["--fully_async.sliding_window=staleness-bounded",
                                                  "--fully_async.stale_steps=1.0", *ABORT]),
    # How the boundary treats the requests in flight.
    ("fully-async, boundary waits", ["--rollout.partial=false", "--rollout.weight_update_mode=wait"]),
    ("fully-async, in-flight updates", ["--rollout.weight_update_mode=inflight"]),
    # The spec's stale 2 without the abort: more groups in flight at each boundary, none re-prefilled.
    ("fully-async, in-flight updates, stale 2.0", ["--rollout.weight_update_mode=inflight", "--fully_async.stale_steps=2.0"]),
    ("fully-async, in-flight updates, KV recomputed", ["--rollout.weight_update_mode=inflight",
                                                       "--rollout.inflight_kv=recompute"]),
]
RUN_TIMEOUT_S = 1800
POLL_S = 0.25


# ---------------------------------------------------------------------------------------- CPU time


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                todo.extend(int(c) for c in open(task).read().split())
            except (OSError, ValueError):
                pass
    return out


def _cpu_seconds(pid: int) -> Optional[tuple[str, float]]:
    """(command line, user + system CPU seconds) of one process, None when it is gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
        cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return cmd, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """Samples, every ``POLL_S``, the CPU seconds of a process and its descendants, by role
    (``trainer``: the process itself; ``engine``: embedded engine servers; ``other``)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.samples = pid, []  # (wall time, {role: cpu seconds summed over live processes})
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()

    @staticmethod
    def role(pid: int, root: int, cmd: str) -> str:
        if pid == root:
            return "trainer"
        return "engine" if "lightning_fasync.engine.server" in cmd else "other"

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for p in _descendants(self.pid):
                got = _cpu_seconds(p)
                if got is not None:
                    self._last[p] = got  # a process that ends keeps its last reading
            by_role: dict[str, float] = {}
            for p, (cmd, cpu) in self._last.items():
                r = self.role(p, self.pid, cmd)
                by_role[r] = by_role.get(r, 0.0) + cpu
            self.samples.append((now, by_role))
            self._stop.wait(POLL_S)

    def stop(self) -> list[tuple[float, dict[str, float]]]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples


def cpu_between(samples: list[tuple[float, dict[str, float]]], t0: float, t1: float) -> dict[str, float]:
    """CPU seconds per role spent between wall times ``t0`` and ``t1`` (nearest samples inside)."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return {}
    (a, ra), (b, rb) = inside[0], inside[-1]
    scale = (t1 - t0) / (b - a) if b > a else 1.0  # the samples span slightly less than the window
    return {k: (rb.get(k, 0.0) - ra.get(k, 0.0)) * scale for k in rb}


# ---------------------------------------------------------------------------------------- one run


def run_one(name: str, overrides: list[str], rnd: int, steps: int, root: str, extra: list[str],
            timeline: Optional[str] = None, config: str = DEFAULT_CONFIG, seed: Optional[int] = None) -> dict[str, Any]:
    """Run `fit` of ``config`` once under ``root`` (with ``seed``: ``--seed_everything=seed``); with
    ``timeline``, draw the run's timeline there (PNG, also logged to the run's TensorBoard as an image)."""
    run_root = os.path.join(root, f"{slug(name)}-{rnd}")
    seeded = [] if seed is None else [f"--seed_everything={seed}"]
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", config,
           f"--trainer.default_root_dir={run_root}", "--trainer.enable_progress_bar=false", "--trainer.save_freq=0",
           f"--trainer.rollout_steps={steps}", *seeded, *overrides, *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    sampler = CpuSampler(proc.pid)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{name} (round {rnd + 1}) did not finish within {RUN_TIMEOUT_S} s: {shlex.join(cmd)}") from None
    finally:
        samples = sampler.stop()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} (round {rnd + 1}) failed ({proc.returncode}):\n{out[-3000:]}")
    log_dir = sorted(glob.glob(os.path.join(run_root, "lightning_logs", "version_*")))[-1]
    if timeline:
        plot_timeline(os.path.join(log_dir, "events.jsonl"), timeline, title=name)
        log_image_to_tensorboard(timeline, log_dir, "timeline")
    tb = read_scalars(log_dir, with_wall_time=True)
    series = lambda tag: [float(v) for _, v, _ in tb.get(tag, [])]  # noqa: E731
    walls = [w for _, _, w in tb.get("timing/step", [])]
    # Wall-clock at the end of each step, from the start of step 0 (start-up excluded).
    first = walls[0] - series("timing/step")[0] if walls else 0.0
    # Steady state: from the end of step 0 to the end of the last step.
    cpu = cpu_between(samples, walls[0], walls[-1]) if len(walls) > 1 else {}
    return {
        "mode": name,
        "round": rnd,
        "steps": steps,
        "overrides": overrides,
        "extra": list(extra),
        "step": series("timing/step"),
        "wait": series("timing/rollout"),
        "train": series("timing/train"),
        "process_traj": series("timing/process_traj"),
        "reward": series("rollout/reward_mean"),
        "pipeline_buf_size": series("rollout/pipeline_buf_size"),
        "partial_ratio": series("rollout/partial_ratio"),
        "partial_restored": series("rollout/partial_restored_count"),
        "cpu_steady": cpu,
        "proc_wall_s": wall,
        "seed": seed,
        "config": os.path.relpath(config, REPO),
        "step_end_s": [w - first for w in walls],
        "response_length_mean": series("rollout/response_length_mean"),
        "response_length_max": series("rollout/response_length_max"),
        "pause_delay": series("timing/pause_delay"),
    }


# ---------------------------------------------------------------------------------------- tables


def mean(xs: list[float]) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


def thirds(n: int) -> list[tuple[str, int, int]]:
    """Steps 1..n-1 (step 0 excluded) in three phases."""
    k = (n - 1) // 3
    return [("early", 1, 1 + k), ("middle", 1 + k, 1 + 2 * k), ("late", 1 + 2 * k, n)]


def run_figures(run: dict[str, Any], cores: int) -> dict[str, Any]:
    step, wait, n = run["step"], run["wait"], len(run["step"])
    ss = step[1:]
    trainer_work = mean([s - w for s, w in zip(step[1:], wait[1:])])
    train = mean([a + b for a, b in zip(run["train"][1:], run["process_traj"][1:] or [0.0] * (n - 1))])
    cpu = run["cpu_steady"]
    per_step = {k: v / max(1, n - 1) for k, v in cpu.items()}
    floor = None
    if trainer_work is not None:
        floor = max(trainer_work, (per_step.get("trainer", 0.0) + per_step.get("engine", 0.0)) / cores)
    fig = {
        "steady": mean(ss),
        "all": mean(step),
        "wait": mean(wait[1:]),
        "trainer_work": trainer_work,
        "train": train,
        "trainer_cpu": per_step.get("trainer"),
        "engine_cpu": per_step.get("engine"),
        "floor": floor,
        "step0": step[0] if step else None,
        "final_reward": mean(run["reward"][-10:]),
        "pause_delay": mean(run.get("pause_delay", [])[1:]),
        # Response tokens the trainer consumed per second of steady state: in steady state what the
        # engines generated and kept (aborted work redone is not counted twice).
        "tokens_per_s": (sum(run["response_length_mean"][1:]) * B * N / sum(ss)
                         if run.get("response_length_mean") and sum(ss) else None),
        "resp_len": mean(run.get("response_length_mean", [])[1:]),
        "pipeline_buf_size": mean(run["pipeline_buf_size"]),
        "partial_ratio": mean(run["partial_ratio"]),
        "partial_restored": mean(run["partial_restored"]),
    }
    for phase, lo, hi in thirds(n):
        fig[phase] = mean(step[lo:hi])
    return fig


def wall_to_reward(reward: list[float], ends: list[float], target: float, window: int = 5) -> Optional[float]:
    """Seconds from step 0's start to the end of the first step where the running mean of the last
    ``window`` rewards reaches ``target``; None when it never does (or the run has no wall-clock)."""
    for i in range(len(reward)):
        if i < len(ends) and statistics.fmean(reward[max(0, i - window + 1): i + 1]) >= target:
            return ends[i]
    return None


def spread(xs: list[Optional[float]]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    xs = [x for x in xs if x is not None]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)


def fmt(s: tuple, nd: int = 2, unit: str = "") -> str:
    med, lo, hi = s
    if med is None:
        return "-"
    return f"{med:.{nd}f}{unit} ({lo:.{nd}f}-{hi:.{nd}f})" if hi - lo > 10 ** -nd / 2 else f"{med:.{nd}f}{unit}"


def summarize(runs: list[dict[str, Any]], cores: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    figs = [{**r, **run_figures(r, cores)} for r in runs]
    base = {f["round"]: f for f in figs if f["mode"] == BASELINE}
    for f in figs:
        b = base.get(f["round"])
        f["speedup"] = b["steady"] / f["steady"] if b else None
        f["speedup_all"] = b["all"] / f["all"] if b else None
        # The same per consumed token: a learning policy's lengths differ by run, and with them each
        # step's work; this ratio takes them out (steady state, consumed tokens/s over colocate's).
        f["tokens_speedup"] = (f["tokens_per_s"] / b["tokens_per_s"]
                               if b and b.get("tokens_per_s") and f.get("tokens_per_s") else None)
        for phase, _, _ in thirds(len(f["step"])):
            f[f"speedup_{phase}"] = b[phase] / f[phase] if b and b[phase] and f[phase] else None
        fa = "--colocate=true" not in f["overrides"]
        f["bound"] = b["steady"] / f["floor"] if b and fa and f["floor"] else None
        f["share"] = f["speedup"] / f["bound"] if f["bound"] and f["speedup"] else None
        if f["mode"] == BASELINE:  # colocate's two-thread overlap bound: (R + T) / max(R, T)
            r, t = f["wait"], f["train"]
            f["colocate_bound"] = (r + t) / max(r, t) if r and t else None
    # Learning: wall-clock (from step 0's start) until the reward's 5-step running mean first reaches
    # colocate's median final reward, and that time over colocate's own, per round.
    target = statistics.median([f["final_reward"] for f in base.values() if f["final_reward"] is not None] or [0.0])
    for f in figs:
        f["wall_to_target"] = wall_to_reward(f.get("reward", []), f.get("step_end_s", []), target)
    for f in figs:
        b = base.get(f["round"])
        f["wall_ratio"] = (b["wall_to_target"] / f["wall_to_target"]
                           if b and b.get("wall_to_target") and f["wall_to_target"] else None)
    modes = list(dict.fromkeys(f["mode"] for f in figs))
    rows = []
    for m in modes:
        fs = [f for f in figs if f["mode"] == m]
        keys = ["steady", "all", "early", "middle", "late", "wait", "trainer_work", "train", "trainer_cpu", "engine_cpu",
                "speedup", "speedup_all", "speedup_early", "speedup_middle", "speedup_late", "bound", "share",
                "final_reward", "pipeline_buf_size", "partial_ratio", "partial_restored", "colocate_bound", "step0",
                "pause_delay", "wall_to_target", "wall_ratio", "tokens_per_s", "tokens_speedup", "resp_len"]
        rows.append({"mode": m, "rounds": len(fs), **{k: spread([f.get(k) for f in fs]) for k in keys}})
    return rows, {"figs": figs}


def markdown(rows: list[dict[str, Any]], steps: int) -> str:
    head = ("| mode | avg step excl. step 0 (s) | speedup | avg step, all steps (s) | speedup, all steps | step 0 (s) | "
            "early / middle / late step (s) | speedup early / middle / late | "
            "trainer wait / work / train (s) | CPU s per step: trainer / engine | honest bound | share of bound | "
            "pipeline_buf_size | partial_ratio | partial_rollout_restored | pause_delay (s) | mean response (tokens) | "
            "consumed tokens/s | against colocate | final reward | wall-clock to colocate's final reward (s) | against colocate |")
    lines = [head, "|" + "---|" * 22]
    for r in rows:
        medians = lambda keys, unit="": " / ".join("-" if r[k][0] is None else f"{r[k][0]:.2f}{unit}" for k in keys)  # noqa: E731
        ph = medians(("early", "middle", "late"))
        sp = medians(("speedup_early", "speedup_middle", "speedup_late"), "x")
        wt = medians(("wait", "trainer_work", "train"))
        cpu = medians(("trainer_cpu", "engine_cpu"))
        share = "-" if r["share"][0] is None else f"{r['share'][0]:.0%} ({r['share'][1]:.0%}-{r['share'][2]:.0%})"
        reached = f"{r['wall_to_target'][0]:.0f} ({r['wall_to_target'][1]:.0f}-{r['wall_to_target'][2]:.0f})" \
            if r["wall_to_target"][0] is not None else "not reached"
        lines.append(
            f"| {r['mode']} | {fmt(r['steady'], 3)} | {fmt(r['speedup'], 2, 'x')} | {fmt(r['all'], 3)} | "
            f"{fmt(r['speedup_all'], 2, 'x')} | {fmt(r['step0'], 2)} | {ph} | {sp} | {wt} | {cpu} | "
            f"{fmt(r['bound'], 2, 'x')} | {share} | {fmt(r['pipeline_buf_size'], 1)} | {fmt(r['partial_ratio'], 3)} | "
            f"{fmt(r['partial_restored'], 1)} | {fmt(r['pause_delay'], 3)} | {fmt(r['resp_len'], 1)} | "
            f"{fmt(r['tokens_per_s'], 0)} | {fmt(r['tokens_speedup'], 2, 'x')} | "
            f"{fmt(r['final_reward'], 3)} | {reached} | "
            f"{fmt(r['wall_ratio'], 2, 'x')} |"
        )
    colo = next((r for r in rows if r["mode"] == BASELINE), None)
    notes = [
        "",
        f"{steps} outer steps per run; median (range) over {rows[0]['rounds']} interleaved round(s). Speedup: each round's "
        "colocate step over the mode's (excl. step 0; early / middle / late: the run's thirds). Trainer wait: "
        "`timing/rollout`; work: step minus wait; train: training calls plus batch assembly. Honest bound: colocate step / "
        "max(trainer work, (trainer + engine CPU) / cores), from each fully-async run at its own thread counts. "
        "Mean response: over the steps after step 0. Consumed tokens/s: the response tokens training used per second "
        "of steady state; against colocate: that over colocate's, per round (the speedup with each run's own response "
        "lengths taken out). "
        "Final reward: mean of the last 10 steps. Wall-clock to colocate's final reward: from step 0's start until the "
        "5-step running mean of the reward first reaches colocate's median final reward (\"not reached\" if never); "
        "against colocate: colocate's time over the mode's, per round (rounds with their own seed when run with "
        "--seed-per-round).",
    ]
    if colo and colo["colocate_bound"][0] is not None:
        notes.append(
            f"Colocate two-thread overlap bound, (rollout + train) / max(rollout, train) from colocate's phases: "
            f"{fmt(colo['colocate_bound'], 2, 'x')} (it assumes each side keeps its two-thread speed on one core, so it is "
            "not a bound on a 1 : 1 split)."
        )
    return "\n".join(lines + notes) + "\n"


CSV_KEYS = ["steady", "all", "early", "middle", "late", "wait", "trainer_work", "train", "trainer_cpu", "engine_cpu", "speedup",
            "speedup_all", "speedup_early", "speedup_middle", "speedup_late", "bound", "share", "final_reward",
            "pipeline_buf_size", "partial_ratio", "partial_restored", "step0", "pause_delay", "wall_to_target", "wall_ratio",
            "tokens_per_s", "tokens_speedup", "resp_len", "colocate_bound"]


def write_outputs(runs: list[dict[str, Any]], out: str, info: dict[str, Any], wall: float, warning: Optional[str]) -> str:
    rows, extra = summarize(runs, info["nproc"])
    text = header("Fully-async against colocate", info, wall, warning) + "\n" + markdown(rows, runs[0]["steps"])
    with open(os.path.join(out, "speedup.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(out, "speedup.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["mode", "rounds"] + [f"{k}_{s}" for k in CSV_KEYS for s in ("median", "min", "max")])
        for r in rows:
            w.writerow([r["mode"], r["rounds"]] + ["" if v is None else f"{v:.4f}" for k in CSV_KEYS for v in r[k]])
    with open(os.path.join(out, "runs.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["mode", "round"] + CSV_KEYS[:-1])
        for f in extra["figs"]:
            w.writerow([f["mode"], f["round"]] + ["" if f.get(k) is None else f"{f[k]:.4f}" for k in CSV_KEYS[:-1]])
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump({**info, "wall_s": wall, "warning": warning}, fh, indent=1)
    return text


def select_modes(only: Optional[list[str]], oversample: int = B // 4) -> list[tuple[str, list[str]]]:
    """The modes to run (``only``: slugs; colocate always), colocate + partial over-dispatching
    ``oversample`` groups."""
    if oversample < 0:
        raise SystemExit(f"--oversample is {oversample}; it must be >= 0 (groups colocate + partial over-dispatches).")
    flag = "--rollout.sampler.num_oversample="
    picked = [(name, ov) for name, ov in MODES if name == BASELINE or only is None or slug(name) in only]
    return [(name, [o for o in ov if not o.startswith(flag)] + ([f"{flag}{oversample}"] if name.startswith("colocate + partial") else []))
            for name, ov in picked]


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 steps, one round: a smoke check")
    parser.add_argument("--steps", type=int, default=120, help="outer steps per run (the default config's whole run)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every mode, interleaved")
    parser.add_argument("--modes", nargs="+", default=None, help="subset of the modes (slugs), colocate always included")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "speedup"))
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the workload (default: the main job)")
    parser.add_argument("--seed-per-round", type=int, metavar="SEED", default=None,
                        help="round r runs every mode with --seed_everything=SEED+r (rounds double as seeds)")
    parser.add_argument("--oversample", type=int, default=B // 4, metavar="K",
                        help="groups colocate + partial over-dispatches (default B // 4; each step still waits for B)")
    parser.add_argument("--from-raw", metavar="DIR", help="no runs: rebuild the tables from DIR/raw/*.json and DIR/meta.json")
    args, extra = parser.parse_known_args(argv)
    if args.from_raw:
        runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(args.from_raw, "raw", "*.json")))]
        meta = json.load(open(os.path.join(args.from_raw, "meta.json")))
        runs.sort(key=lambda r: (r["round"], [m for m, _ in MODES].index(r["mode"]) if r["mode"] in dict(MODES) else 99))
        print(write_outputs(runs, args.from_raw, meta, meta.get("wall_s", float("nan")), meta.get("warning")))
        return
    steps, rounds = (20, 1) if args.quick else (args.steps, args.rounds)
    modes = select_modes(args.modes, args.oversample)
    info = {**record(), "command": "python benchmarks/speedup.py" + (" " + shlex.join(argv) if argv else "")}
    warning = check_load(info)
    raw_dir = os.path.join(args.out, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="speedup-")
    t0 = time.perf_counter()
    runs = []
    try:
        for rnd in range(rounds):
            for name, overrides in modes:
                print(f"[round {rnd + 1}/{rounds}] {name} ...", end=" ", flush=True)
                png = os.path.join(args.out, f"timeline-{slug(name)}.png") if rnd == 0 else None
                seed = None if args.seed_per_round is None else args.seed_per_round + rnd
                run = run_one(name, overrides, rnd, steps, tmp, extra, timeline=png, config=os.path.abspath(args.config),
                              seed=seed)
                with open(os.path.join(raw_dir, f"{slug(name)}-{rnd}.json"), "w") as fh:
                    json.dump(run, fh)
                print(f"{statistics.fmean(run['step'][1:]):.3f} s/step, {run['proc_wall_s']:.0f} s", flush=True)
                runs.append(run)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info["load_after"] = os.getloadavg()
    print(write_outputs(runs, args.out, info, time.perf_counter() - t0, warning))


if __name__ == "__main__":
    main()

"""Soak: a long fully-async run with engine replicas killed on a schedule, against a fault-free run.

Runs the embedded default (`configs/tiny_cpu.yaml`) for `--steps` outer steps (500) with two
engine replicas behind the sglang-router, twice in one invocation: fault-free, then with one
replica SIGKILLed (its whole process tree, the router not told) every `--every` steps (100); one of
those kills lands inside a weight sync, the others mid-generation. It reports

- steps/s of the faulty run against the fault-free one, whole run and per 50-step window (target
  >= 90 % over the whole run);
- for each kill: the time until the supervisor noticed (`engine_dead`), and until the replica
  served again with the trainer's weights (`engine_restarted`: restart and down time);
- RSS, threads and open file descriptors of every process (trainer, each engine, router), sampled at
  every step boundary: after warm-up against the end (growth after warm-up < 5 %; no fd or thread
  leak in the trainer), and the RSS curve (`rss.png`);
- the ledger audit: every prompt trained once, every drop with its reason.

    python benchmarks/soak.py                    # ~8 minutes on 2 cores
    python benchmarks/soak.py --steps 120 --every 40 --out /tmp/soak   # a shorter look
    python benchmarks/soak.py --steps 300 --every 0    # memory alone: one fault-free run, RSS every step

Raw output (per-step times, process samples, fault events, the summary) goes to
`benchmarks/results/soak/<date>/` unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

B = 16
SAMPLE_EVERY = 1  # process samples: RSS, threads and fds of every process at every step boundary
WINDOW = 50


# ---------------------------------------------------------------------------------------- child


def _proc_stats(pid: int) -> Optional[dict[str, int]]:
    try:
        status = open(f"/proc/{pid}/status").read()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]), "fds": fds}


def _sample(pool: Any, step: int) -> dict[str, Any]:
    procs = {"trainer": os.getpid()}
    for i, handle in enumerate(pool.servers):
        procs[f"engine-{i}"] = handle.pid
    if pool.router is not None:
        procs["router"] = pool.router.pid  # the supervisor; the sglang-router is its child
        try:
            children = open(f"/proc/{pool.router.pid}/task/{pool.router.pid}/children").read().split()
            if children:
                procs["router"] = int(children[0])
        except OSError:
            pass
    return {"step": step, "wall": time.time(),
            "procs": {role: {"pid": pid, **(_proc_stats(pid) or {})} for role, pid in procs.items()}}


def child(argv: list[str]) -> int:
    """Run `lightning-fasync fit` in this process with the kills and samples hooked into the weight sync."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--stats", required=True)
    parser.add_argument("--kills", default="")  # step[:sync],...
    ours, fit_args = parser.parse_known_args(argv)
    kills: dict[int, str] = {}
    for item in filter(None, ours.kills.split(",")):
        step, _, phase = item.partition(":")
        kills[int(step)] = phase or "mid"
    out = open(ours.stats, "a", buffering=1)

    from lightning_fasync.runtime import rollout_runtime as rt
    from lightning_fasync.lightning.cli import main

    original = rt.RolloutRuntime.sync_weights
    victim = [0]

    def kill(pool: Any, step: int, phase: str) -> None:
        index = victim[0] % len(pool.servers)
        victim[0] += 1
        handle = pool.servers[index]
        try:
            os.killpg(handle.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        out.write(json.dumps({"kill": {"step": step, "phase": phase, "replica": index, "pid": handle.pid, "wall": time.time()}}) + "\n")

    def sync_weights(self: Any, tensors: Any, version: int) -> None:
        step = version - 1  # the boundary that ends `step` pushes version step + 1
        phase = kills.get(step) if self.pool is not None else None
        if phase == "sync":
            kill(self.pool, step, phase)  # the push meets a replica that just died
        original(self, tensors, version)
        if phase == "mid":
            threading.Timer(0.15, kill, (self.pool, step, phase)).start()  # during the next step's generation
        if self.pool is not None and version % SAMPLE_EVERY == 0:
            out.write(json.dumps(_sample(self.pool, step)) + "\n")

    rt.RolloutRuntime.sync_weights = sync_weights
    sys.argv = sys.argv[:1]  # the fit arguments go in as `args`, not twice
    return main(fit_args)


# ---------------------------------------------------------------------------------------- parent


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run(name: str, out: str, steps: int, kills: str) -> dict[str, Any]:
    root = os.path.join(out, name)
    os.makedirs(root, exist_ok=True)
    stats = os.path.join(root, "process_samples.jsonl")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--stats", stats, "--kills", kills,
           "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"), f"--trainer.rollout_steps={steps}",
           "--trainer.save_freq=100", f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
           "--trainer.strategy=lightning_fasync.lightning.strategy.FullyAsyncStrategy",
           "--trainer.strategy.rollout_replicas=2", "--trainer.strategy.trainer_cores=[0]",
           "--trainer.strategy.rollout_cores=[0,1]"]
    t0 = time.monotonic()
    limit = 600 + 10 * steps  # seconds: start-up plus ten times the slowest step seen on 2 cores
    with open(os.path.join(root, "run.log"), "w") as log:
        try:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=limit)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{name}: fit did not finish within {limit} s; see {os.path.join(root, 'run.log')}") from None
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"{name}: fit exited {rc}; see {os.path.join(root, 'run.log')}")
    logs = os.path.join(root, "lightning_logs", "version_0")
    events = _read_jsonl(os.path.join(logs, "events.jsonl"))
    ledger = _read_jsonl(os.path.join(logs, "ledger.jsonl"))
    samples = _read_jsonl(stats)
    syncs = [e for e in events if e["event"] == "sync"]
    faults = [e for e in events if e["event"].startswith(("engine_", "router_"))]
    # Keep the raw output small: per-step boundary times and the fault events, not every group's events.
    with open(os.path.join(root, "step_times.csv"), "w") as f:
        f.write("step,t\n" + "".join(f"{e['step']},{e['t']}\n" for e in syncs))
    with open(os.path.join(root, "fault_events.jsonl"), "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in faults))
    with open(os.path.join(logs, "ledger.jsonl"), "rb") as src, gzip.open(os.path.join(root, "ledger.jsonl.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.rmtree(os.path.join(root, "lightning_logs"))  # checkpoints, TensorBoard, the full event log
    with open(os.path.join(root, "run.log")) as f:
        text = f.read()
    with open(os.path.join(root, "run.log"), "w") as f:  # paths relative to the repository
        f.write(text.replace(REPO + os.sep, ""))
    return {"name": name, "wall_s": wall, "syncs": syncs, "faults": faults, "ledger": ledger,
            "samples": [s for s in samples if "procs" in s], "kills": [s["kill"] for s in samples if "kill" in s]}


def _audit(ledger: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    consumed = [r["prompt"] for r in ledger if r["kind"] == "consume"]
    drops = [r for r in ledger if r["kind"] == "drop"]
    return {
        "consumed": len(consumed),
        "expected": steps * B,
        "unique": len(set(consumed)) == len(consumed),
        "drops": len(drops),
        "drops_without_reason": sum(1 for r in drops if not r.get("reason")),
        "engine_fault_recycles": sum(1 for r in ledger if r["kind"] == "recycle" and r.get("reason") == "engine_fault"),
        "ok": len(consumed) == steps * B and len(set(consumed)) == len(consumed) and all(r.get("reason") for r in drops),
    }


def _rate(syncs: list[dict[str, Any]], lo: int, hi: int) -> Optional[float]:
    """Steps per second over boundaries lo..hi."""
    by = {e["step"]: e["t"] for e in syncs}
    if lo not in by or hi not in by or hi <= lo:
        return None
    return (hi - lo) / (by[hi] - by[lo])


def _growth(samples: list[dict[str, Any]], role: str, key: str, warm_step: int) -> Optional[tuple[int, int, float]]:
    """(after warm-up, at the end, growth %) of one process; after warm-up means its first sample
    at or past ``warm_step`` that is at least one sample after the process started (a restarted
    replica is measured from its own warm-up)."""
    end = next((s for s in reversed(samples) if key in s["procs"].get(role, {})), None)
    if end is None:
        return None
    pid = end["procs"][role]["pid"]
    own = [s for s in samples if s["procs"].get(role, {}).get("pid") == pid and key in s["procs"][role]]
    warm = next((s for s in own[1:] if s["step"] >= warm_step), None) if own and own[0] is not samples[0] else \
        next((s for s in own if s["step"] >= warm_step), None)
    if warm is None:
        return None
    a, b = warm["procs"][role][key], end["procs"][role][key]
    return a, b, (b - a) / a * 100 if a else 0.0


def plot_rss(runs: list[dict[str, Any]], png: str) -> str:
    """RSS (MiB) of every process against the step, one panel per run; returns ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        roles = sorted({role for s in run["samples"] for role in s["procs"]})
        for role in roles:
            pts = [(s["step"], s["procs"][role]["rss_kb"] / 1024) for s in run["samples"] if "rss_kb" in s["procs"].get(role, {})]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=role, linewidth=1.2)
        for k in run["kills"]:
            ax.axvline(k["step"], color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(run["name"].replace("_", "-"))
        ax.set_xlabel("rollout step")
        ax.set_ylabel("RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _machine() -> dict[str, Any]:
    from _machine import cpu_model

    model = cpu_model()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "nproc": os.cpu_count(), "cpu": model,
            "loadavg_before": os.getloadavg(), "python": platform.python_version()}


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--every", type=int, default=100, help="kill a replica every this many steps (0: no faulty run)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "soak", time.strftime("%Y-%m-%d")))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    machine = _machine()
    kill_steps = list(range(args.every, args.steps, args.every)) if args.every > 0 else []
    # The middle kill lands inside a weight sync; the others during generation.
    sync_at = kill_steps[len(kill_steps) // 2] if kill_steps else None
    kills = ",".join(f"{s}:sync" if s == sync_at else f"{s}:mid" for s in kill_steps)

    base = _run("fault_free", args.out, args.steps, "")
    faulty = _run("faulty", args.out, args.steps, kills) if kills else None  # --every 0: the fault-free run alone
    runs = [base] if faulty is None else [base, faulty]
    machine["loadavg_after"] = os.getloadavg()
    plot_rss(runs, os.path.join(args.out, "rss.png"))

    warm = min(WINDOW, args.steps // 4)
    whole = (_rate(faulty["syncs"], warm, args.steps - 1) if faulty else None, _rate(base["syncs"], warm, args.steps - 1))
    ratio = whole[0] / whole[1] if all(whole) else None
    windows = []
    for lo in range(0, args.steps - 1, WINDOW):
        hi = min(lo + WINDOW, args.steps - 1)
        a, b = _rate(faulty["syncs"], lo, hi) if faulty else None, _rate(base["syncs"], lo, hi)
        windows.append({"steps": f"{lo}-{hi}", "faulty": a, "fault_free": b, "ratio": a / b if a and b else None})

    recoveries = []
    for k in faulty["kills"] if faulty else []:
        dead = next((e for e in faulty["faults"] if e["event"] == "engine_dead" and e.get("wall", 0) >= k["wall"] - 0.01), None)
        back = next((e for e in faulty["faults"] if e["event"] == "engine_restarted" and e.get("wall", 0) >= k["wall"]), None)
        recoveries.append({
            **k,
            "detect_s": round(dead["wall"] - k["wall"], 3) if dead else None,
            "restart_s": back["restart_s"] if back else None,
            "down_s": round(back["wall"] - k["wall"], 3) if back else None,
            "weight_version": back["weight_version"] if back else None,
        })

    procs = {}
    for run in runs:
        roles = sorted({role for s in run["samples"] for role in s["procs"]})
        procs[run["name"]] = {role: {key: _growth(run["samples"], role, key, warm) for key in ("rss_kb", "threads", "fds")}
                              for role in roles}
    audits = {run["name"]: _audit(run["ledger"], args.steps) for run in runs}
    summary = {"machine": machine, "steps": args.steps, "kills": kills, "steps_per_s": {"faulty": whole[0], "fault_free": whole[1]},
               "ratio": ratio, "windows": windows, "recoveries": recoveries, "processes": procs, "audit": audits,
               "wall_s": {run["name"]: run["wall_s"] for run in runs}}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)

    lines = [
        f"# Soak: {args.steps} steps, 2 replicas, a replica SIGKILLed at steps {kills or 'none'}",
        "",
        f"{machine['date']}; nproc {machine['nproc']}; {machine['cpu']}; load average before "
        f"{' '.join(f'{x:.2f}' for x in machine['loadavg_before'])}, after {' '.join(f'{x:.2f}' for x in machine['loadavg_after'])}",
        "",
        f"Steps/s after warm-up (steps {warm}-{args.steps - 1}): faulty {whole[0]:.3f}, fault-free {whole[1]:.3f}, "
        f"ratio **{ratio:.1%}** (target >= 90 %)" if ratio else "Steps/s: not measured",
        "",
        "The two runs are sequential (fault-free first). Trainer and both replicas share the 2 cores, so a replica "
        "that is down also leaves more CPU to the others; the per-window ratios show the load of the machine as well.",
        "",
        "| steps | faulty steps/s | fault-free steps/s | ratio |",
        "|---|---|---|---|",
        *(f"| {w['steps']} | {w['faulty'] or float('nan'):.3f} | {w['fault_free'] or float('nan'):.3f} | "
          f"{(w['ratio'] or float('nan')):.1%} |" for w in windows),
        "",
        f"RSS of every process at every step boundary: rss.png (growth after warm-up, step {warm}, below).",
        "",
        "| kill at step | phase | replica | noticed after (s) | restart (s) | down (s) | weights version |",
        "|---|---|---|---|---|---|---|",
        *(f"| {r['step']} | {r['phase']} | {r['replica']} | {r['detect_s']} | {r['restart_s']} | {r['down_s']} | "
          f"{r['weight_version']} |" for r in recoveries),
        "",
        "| run | process | RSS KiB warm -> end (growth) | threads | fds |",
        "|---|---|---|---|---|",
    ]
    for name, roles in procs.items():
        for role, g in roles.items():
            cell = lambda v: f"{v[0]} -> {v[1]} ({v[2]:+.1f} %)" if v else "n/a"  # noqa: E731
            lines.append(f"| {name} | {role} | {cell(g['rss_kb'])} | {cell(g['threads'])} | {cell(g['fds'])} |")
    lines += ["", "| run | consumed | expected | each once | drops (without reason) | engine-fault recycles |",
              "|---|---|---|---|---|---|"]
    for name, a in audits.items():
        lines.append(f"| {name} | {a['consumed']} | {a['expected']} | {a['unique']} | {a['drops']} ({a['drops_without_reason']}) | "
                     f"{a['engine_fault_recycles']} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    ok = all(a["ok"] for a in audits.values()) and all(r["detect_s"] is not None and r["down_s"] is not None for r in recoveries)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Every GPU check in one run with an overall deadline (docs/gpu.md), most valuable first.

    ./scripts/gpu-check --budget-s 480 --out "$OUT"

``scripts/gpu-check`` installs the carried wheels (``scripts/fetch-gpu-wheels``) into a target
folder, puts it and the checkout on ``PYTHONPATH`` and runs this driver. On a machine with no GPU the
same command runs every stage on the CPU with tiny shapes: that is the CPU rehearsal CI runs
(``scripts/gpu-rehearsal``), with the GPU image's package set enforced.

The stages, each a child process in a process group of its own, killed at its deadline:

1. ``fit``: the main job (``configs/tiny_cpu.yaml``) fully-async, the trainer on the GPU and the
   embedded engine on the same GPU as a second process (``rollout.engine_device``); step time,
   reward, weight-sync time.
2. ``engine``: the embedded engine over HTTP against HF ``generate`` (bf16, the Qwen3-0.6B shape).
3. ``weight_sync``: the ``tensor`` (CUDA IPC) and ``disk`` paths, each its own child, each in
   seconds and GB/s beside its medium's rate (a device-to-device copy; a file written and read).
4. ``colocate``: the main job colocated with ``colocate_offload``: the offload and onload stages.
5. ``megatron``: ``benchmarks/gpu_megatron_check.py`` (logits against HF with HF's own bf16-vs-fp32
   difference as the tolerance, the export round trip, training steps, RL steps).

First, in a few seconds, a child process reports the interpreter, the versions and every import
the stages need; a stage whose imports are missing is skipped with a row saying which. Each stage's
deadline is the smaller of its own limit and the time left; a stage that cannot get its minimum is
skipped with a row saying so; a stage that fails or times out keeps the other stages' results.
GPU memory is read after each stage (every stage's processes have exited by then).

Writes at most 7 files under ``--out``, no more than one folder down: ``summary.md``,
``summary.json`` and ``logs/<stage>.log``; the runs' own directories go to a scratch folder outside
it. Prints the summary table last. Exit status: 0 when no stage failed (skipped stages do not fail
the run), 1 otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN_JOB = os.path.join(REPO, "configs", "tiny_cpu.yaml")

PREFLIGHT = r"""
import importlib, json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable, "modules": {}}
for name in sys.argv[1:]:
    try:
        mod = importlib.import_module(name)
        out["modules"][name] = {"ok": True, "version": str(getattr(mod, "__version__", ""))}
    except BaseException as exc:
        out["modules"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
try:
    import torch
    out["cuda"] = torch.cuda.is_available()
    if out["cuda"]:
        out["gpu"] = torch.cuda.get_device_name(0)
        free, total = torch.cuda.mem_get_info()
        out["gpu_mem_gib"] = [round(free / 2**30, 1), round(total / 2**30, 1)]
except BaseException as exc:
    out["cuda"] = False
    out["torch_error"] = str(exc)[:300]
print("PREFLIGHT " + json.dumps(out))
"""

GPU_MEMORY = r"""
import torch
free, total = torch.cuda.mem_get_info()
print(f"{(total - free) / 2**30:.2f} GiB in use of {total / 2**30:.1f} GiB")
"""


@dataclass
class Row:
    check: str
    result: str
    detail: str = ""
    status: str = "ok"
    """ok | FAILED | TIMED OUT | skipped"""


@dataclass
class Ctx:
    device: str
    quick: bool
    out: str
    scratch: str
    py: str = sys.executable
    logs: str = ""

    def log_path(self, stage: str) -> str:
        return os.path.join(self.logs, f"{stage}.log")


@dataclass
class Stage:
    name: str
    run: Callable[[Ctx, float], list[Row]]
    min_s: float
    """Seconds below which the stage is not started."""
    max_s: float
    """The stage's own deadline on the GPU (the CPU rehearsal's shapes take about as long)."""
    needs: list[str] = field(default_factory=list)
    """Modules the stage imports (checked by the preflight)."""


def run_child(cmd: list[str], log: str, timeout: float, env: Optional[dict[str, str]] = None) -> tuple[int, str]:
    """``cmd`` in its own process group, output appended to ``log``; killed (group and all) at
    ``timeout``: (exit status, 124 on timeout; output)."""
    t0 = time.monotonic()
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, _ = proc.communicate()
        code = 124
        out = (out or "") + f"\nTIMED OUT after {timeout:.0f} s (process group killed)\n"
    _kill_group(proc.pid)  # whatever the child left behind in its group
    with open(log, "a") as fh:
        fh.write(f"{out}\n[exit {code} after {time.monotonic() - t0:.0f} s]\n\n")
    return code, out or ""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def failed(check: str, code: int, stage: str) -> Row:
    if code == 124:
        return Row(check, "TIMED OUT", f"see logs/{stage}.log", "TIMED OUT")
    return Row(check, f"FAILED (exit {code})", f"see logs/{stage}.log", "FAILED")


def _median(values: list[float]) -> float:
    vals = sorted(v for v in values if math.isfinite(v))
    return vals[len(vals) // 2] if vals else float("nan")


def _run_dir_scalars(root: str) -> dict[str, list[float]]:
    sys.path.insert(0, REPO)
    from lightning_fasync.plots import read_scalars

    versions = sorted(os.listdir(os.path.join(root, "lightning_logs")))
    tb = read_scalars(os.path.join(root, "lightning_logs", versions[-1]))
    return {k: [v for _, v in pts] for k, pts in tb.items()}


def _fit(ctx: Ctx, timeout: float, stage: str, steps: int, extra: list[str]) -> tuple[int, dict[str, list[float]]]:
    root = os.path.join(ctx.scratch, stage)
    shutil.rmtree(root, ignore_errors=True)
    cmd = [ctx.py, "-m", "lightning_fasync.cli", "fit", "--config", MAIN_JOB, f"--trainer.rollout_steps={steps}",
           f"--trainer.default_root_dir={root}", "--trainer.save_freq=0", "--trainer.enable_progress_bar=false",
           f"--rollout.engine_device={ctx.device}", *extra]
    code, _ = run_child(cmd, ctx.log_path(stage), timeout)
    if code != 0:
        return code, {}
    return 0, _run_dir_scalars(root)


def stage_fit(ctx: Ctx, timeout: float) -> list[Row]:
    steps = 6 if ctx.quick else 30
    code, tb = _fit(ctx, timeout, "fit", steps, [])
    check = f"main job fully-async fit, trainer + engine on {ctx.device} ({steps} steps)"
    if code != 0:
        return [failed(check, code, "fit")]
    step = tb.get("timing/step", [])
    reward = tb.get("rollout/reward_mean", [])
    sync = tb.get("timing/update_weights", [])
    done = len(step) == steps and all(math.isfinite(v) for v in tb.get("train/loss", [float("nan")]))
    head, tail = reward[: max(1, len(reward) // 5)], reward[-max(1, len(reward) // 5):]
    return [Row(check, f"{_median(step[1:]):.3f} s/step (median, step 0 excluded; step 0 {step[0]:.2f} s)" if step else "no steps",
                f"reward {sum(head) / len(head):.3f} -> {sum(tail) / len(tail):.3f} (first and last fifth of the steps); "
                f"update_weights {_median(sync):.3f} s median" if reward else "no reward logged",
                "ok" if done else "FAILED")]


def stage_engine(ctx: Ctx, timeout: float) -> list[Row]:
    if ctx.quick:
        preset, dtype, requests, new_tokens = "tiny", "float32", 4, 8
    else:
        preset, dtype, requests, new_tokens = "qwen3-0.6b-shape", "bfloat16", 64, 256
    cmd = [ctx.py, "benchmarks/engine_throughput.py", "--device", ctx.device, "--preset", preset, "--dtype", dtype,
           "--requests", str(requests), "--max-new-tokens", str(new_tokens), "--max-running-requests", str(requests),
           "--scenarios", "uniform", "--repeats", "2", "--sequential-sample", "0", "--context-length", str(new_tokens + 64)]
    code, out = run_child(cmd, ctx.log_path("engine"), timeout)
    check = f"embedded engine over HTTP vs HF generate ({preset}, {dtype}, {requests} x {new_tokens} tokens)"
    hf = re.search(r"\[uniform\] HF generate .*median ([\d,]+) tokens/s", out)
    eng = re.search(r"\[uniform\] embedded engine .*median ([\d,]+) tokens/s", out)
    ratio = re.search(r"\[uniform\] ratio engine / HF generate: best ([\d.]+)x, median ([\d.]+)x", out)
    if code != 0 or not (hf and eng and ratio):
        return [failed(check, code or 1, "engine")]
    return [Row(check, f"{eng.group(1)} tokens/s (median of 2)",
                f"HF generate {hf.group(1)} tokens/s; engine / HF {ratio.group(2)}x (best {ratio.group(1)}x)")]


def stage_weight_sync(ctx: Ctx, timeout: float) -> list[Row]:
    """Each path in its own child, so that one path's failure keeps the other's figures."""
    model, dtype, extra = ("tiny", "float32", ["--repeats", "1"]) if ctx.quick else ("qwen3-0.6b-shape", "bfloat16", ["--repeats", "3"])
    rows: list[Row] = []
    deadline = time.monotonic() + timeout
    for path in ("tensor", "disk"):
        out_dir = os.path.join(ctx.scratch, f"weight_sync_{path}")
        check = f"weight sync `{path}` ({model}, {dtype}, {ctx.device})"
        left = deadline - time.monotonic()
        if left < 5:
            rows.append(Row(check, "skipped", f"{left:.0f} s left of the stage's deadline", "skipped"))
            continue
        cmd = [ctx.py, "benchmarks/weight_sync.py", "--device", ctx.device, "--models", model, "--dtypes", dtype,
               "--paths", path, "--no-sharded", "--out", out_dir, *extra]
        code, _ = run_child(cmd, ctx.log_path("weight_sync"), left)
        results = os.path.join(out_dir, "results.csv")
        if code != 0 or not os.path.exists(results):
            rows.append(failed(check, code or 1, "weight_sync"))
            continue
        with open(results) as fh:
            for r in csv.DictReader(fh):
                rows.append(Row(f"weight sync `{r['path']}` ({r['dtype']}, {r['mb']} MB, {ctx.device})",
                                f"{float(r['push_s']):.3f} s, {float(r['gb_s']):.2f} GB/s",
                                f"its medium ({r['medium']}): {float(r['medium_gb_s']):.2f} GB/s "
                                f"(the push at {float(r['ratio']):.0%} of it)"))
    return rows


def stage_colocate(ctx: Ctx, timeout: float) -> list[Row]:
    steps = 3 if ctx.quick else 5
    code, tb = _fit(ctx, timeout, "colocate", steps, ["--colocate=true", "--fully_async.enable=false", "--colocate_offload=true"])
    check = f"main job colocated with colocate_offload on {ctx.device} ({steps} steps)"
    if code != 0:
        return [failed(check, code, "colocate")]
    names = ("timing/offload_train", "timing/onload_train", "timing/offload_rollout", "timing/onload_rollout")
    seen = {n.split("/")[1]: tb.get(n, []) for n in names}
    done = len(tb.get("timing/step", [])) == steps and all(seen[k] for k in ("offload_train", "onload_train"))
    return [Row(check, ", ".join(f"{k} {_median(v):.3f} s" for k, v in seen.items() if v) or "no offload stage logged",
                f"median over {steps} steps; step {_median(tb.get('timing/step', [])):.2f} s",
                "ok" if done else "FAILED")]


def stage_megatron(ctx: Ctx, timeout: float) -> list[Row]:
    out_dir = os.path.join(ctx.scratch, "megatron")
    cmd = [ctx.py, "benchmarks/gpu_megatron_check.py", "--device", ctx.device, "--out", out_dir, "--steps", "3",
           "--fit-root", os.path.join(ctx.scratch, "megatron_fit"), *(["--quick"] if ctx.quick else [])]
    code, _ = run_child(cmd, ctx.log_path("megatron"), timeout)
    rows: list[Row] = []
    summary = os.path.join(out_dir, "summary.md")
    if os.path.exists(summary):  # written row by row: a killed run keeps what it finished
        with open(summary) as fh:
            for line in fh.read().splitlines()[2:]:
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) == 3:
                    bad = cells[1] in ("FAILED", "MISMATCH", "INCOMPLETE") or cells[2].startswith("LOSS NOT FALLING")
                    rows.append(Row(f"megatron: {cells[0]}", cells[1], cells[2], "FAILED" if bad else "ok"))
    if code != 0 and not any(r.status == "FAILED" for r in rows):
        rows.append(failed("megatron check", code, "megatron"))
    return rows


STAGES = [
    Stage("fit", stage_fit, 45, 150, ["jsonargparse", "lightning_fasync.lightning.cli", "tensorboard"]),
    Stage("engine", stage_engine, 40, 120, ["aiohttp", "lightning_fasync.engine.server"]),
    Stage("weight_sync", stage_weight_sync, 30, 90, ["aiohttp", "lightning_fasync.weights.sync"]),
    Stage("colocate", stage_colocate, 45, 110, ["jsonargparse", "lightning_fasync.lightning.cli"]),
    Stage("megatron", stage_megatron, 60, 200, ["megatron.core", "jsonargparse", "lightning_fasync.trainers.megatron"]),
]
BASE_MODULES = ["torch", "transformers", "lightning", "safetensors", "tokenizers", "numpy"]


def preflight(ctx: Ctx, timeout: float) -> dict:
    modules = list(dict.fromkeys(BASE_MODULES + [m for s in STAGES for m in s.needs]))
    code, out = run_child([ctx.py, "-c", PREFLIGHT, *modules], ctx.log_path("preflight"), timeout)
    line = next((ln for ln in out.splitlines() if ln.startswith("PREFLIGHT ")), None)
    if code != 0 or line is None:
        return {"error": f"the preflight child exited {code}: see logs/preflight.log", "modules": {}}
    return json.loads(line[len("PREFLIGHT "):])


def gpu_memory(ctx: Ctx) -> str:
    if ctx.device == "cpu":
        return ""
    code, out = run_child([ctx.py, "-c", GPU_MEMORY], ctx.log_path("preflight"), 60)
    return out.strip().splitlines()[-1] if code == 0 and out.strip() else "unread"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock seconds for the whole run, preflight included")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results", "gpu"))
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is visible, else cpu with tiny shapes), cuda or cpu")
    p.add_argument("--stages", default=",".join(s.name for s in STAGES), help="comma-separated subset, in this order")
    p.add_argument("--scratch", default=None, help="where the runs' own directories go (a temporary folder by default)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(wanted) - {s.name for s in STAGES})
    if unknown:
        p.error(f"--stages names {unknown}; the stages are {[s.name for s in STAGES]}.")
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    for name in os.listdir(logs):  # a rerun into the same folder starts its logs afresh
        if name.endswith(".log"):
            os.remove(os.path.join(logs, name))
    scratch = args.scratch or tempfile.mkdtemp(prefix="gpu-check-")
    ctx = Ctx(device="cpu", quick=True, out=args.out, scratch=scratch, logs=logs)

    pre = preflight(ctx, 60.0)  # always run (a few seconds): it counts against the budget, and says what is missing
    cuda = bool(pre.get("cuda"))
    ctx.device = {"auto": "cuda" if cuda else "cpu"}.get(args.device, args.device)
    ctx.quick = ctx.device == "cpu"
    missing = {m: info["error"] for m, info in pre.get("modules", {}).items() if not info["ok"]}
    versions = {m: info["version"] for m, info in pre.get("modules", {}).items() if info["ok"] and info["version"]}
    print(f"[gpu_all] python {pre.get('python', '?')}, device {ctx.device}"
          f"{' (' + pre['gpu'] + ')' if pre.get('gpu') else ''}, budget {args.budget_s:.0f} s; versions: "
          + ", ".join(f"{m} {v}" for m, v in versions.items() if "." not in m or m == "megatron.core"), flush=True)
    for m, err in missing.items():
        print(f"[gpu_all] MISSING {m}: {err}", flush=True)

    rows: list[Row] = []
    if "error" in pre:
        rows.append(Row("preflight", "FAILED", pre["error"], "FAILED"))
    if args.device == "cuda" and not cuda:
        rows.append(Row("preflight", "FAILED", "--device cuda, but torch sees no CUDA device", "FAILED"))
    stage_s: dict[str, float] = {}
    for stage in (s for s in STAGES if s.name in wanted):
        left = deadline - time.monotonic()
        lacking = [m for m in stage.needs if m in missing]
        if lacking:
            rows.append(Row(stage.name, "skipped", f"missing {', '.join(lacking)} ({missing[lacking[0]]})", "skipped"))
        elif left < stage.min_s:
            rows.append(Row(stage.name, "skipped", f"{left:.0f} s of the budget left, the stage needs {stage.min_s:.0f} s",
                            "skipped"))
        elif ctx.device != "cpu" and not cuda:
            rows.append(Row(stage.name, "skipped", "no CUDA device", "skipped"))
        else:
            timeout = min(stage.max_s, left)
            print(f"[gpu_all] {stage.name}: up to {timeout:.0f} s ({left:.0f} s of the budget left)", flush=True)
            s0 = time.monotonic()
            try:
                got = stage.run(ctx, timeout)
            except Exception as exc:  # a parse or file error: the stage fails, the run goes on
                with open(ctx.log_path(stage.name), "a") as fh:
                    fh.write(f"driver error: {type(exc).__name__}: {exc}\n")
                got = [Row(stage.name, "FAILED", f"driver error {type(exc).__name__}: {exc}"[:200], "FAILED")]
            stage_s[stage.name] = time.monotonic() - s0
            mem = gpu_memory(ctx)
            if mem:
                got[-1].detail += f"; GPU memory after the stage: {mem}" if got else ""
            rows += got or [Row(stage.name, "FAILED", "the stage reported nothing", "FAILED")]
            print(f"[gpu_all] {stage.name}: {', '.join(r.status for r in got)} in {stage_s[stage.name]:.0f} s", flush=True)

    wall = time.monotonic() - t0
    head = (f"# GPU check: {ctx.device}{' (' + pre['gpu'] + ')' if pre.get('gpu') else ''}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n\n"
            f"Python {pre.get('python', '?')}; " + ", ".join(f"{m} {v}" for m, v in versions.items() if "." not in m or m == "megatron.core")
            + f". Budget {args.budget_s:.0f} s, used {wall:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in stage_s.items())
            + ")." + (f" Missing: {', '.join(missing)}." if missing else "") + "\n\n")
    table = "| check | result | detail | status |\n|---|---|---|---|\n" + "".join(
        "| " + " | ".join(c.replace("|", "\\|") for c in (r.check, r.result, r.detail, r.status)) + " |\n" for r in rows)
    with open(os.path.join(args.out, "summary.md"), "w") as fh:
        fh.write(head + table)
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump({"device": ctx.device, "budget_s": args.budget_s, "wall_s": round(wall, 1), "preflight": pre,
                   "stage_s": {k: round(v, 1) for k, v in stage_s.items()}, "rows": [r.__dict__ for r in rows]}, fh, indent=1)
    if not args.scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    print("\n" + head + table, flush=True)
    return 1 if any(r.status in ("FAILED", "TIMED OUT") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Weight sync: each path's seconds and GB/s against a plain copy of the same bytes, in one run.

For each model (``tiny``, and ``qwen3-0.6b-shape``: Qwen3-0.6B's dimensions, 0.6 B parameters,
random float32 weights, on CPU), one embedded engine process is started and the trainer's weights
(this process) are pushed to it ``--repeats`` times over each path of
:mod:`lightning_fasync.rollout.weight_sync`: ``distributed`` (gloo broadcast of flattened buckets),
``tensor`` (SGLang-serialised buckets in shared memory) and ``disk`` (a safetensors directory).
A push is the whole sequence a step boundary runs: pause, flush, bracket, every bucket, flush,
continue; the engine's own load (copy into its parameters, rebuild of its fused matrices) is part
of it. ``distributed`` forms its group once, before the timed pushes (reported as "connect").

The reference is a plain in-memory copy of the same tensors into preallocated ones, timed in the
same run (``torch`` ``copy_``, the trainer's threads): the ratio column is the path's rate over it
(target >= 50 %). Every path copies at least twice (into its bucket or file, then into the
engine's parameters), so 50 % is about what one extra copy allows.

    python benchmarks/weight_sync.py                 # both models, every path (minutes; 2 x 2.4 GB for 0.6B)
    python benchmarks/weight_sync.py --quick         # tiny only, a smoke run
    python benchmarks/weight_sync.py --models tiny --paths tensor,disk --repeats 5

Prints a Markdown table; writes ``results.csv``, ``results.md`` and ``meta.json`` (nproc, CPU
model, load average before and after, date, git commit) to ``--out``
(default ``benchmarks/results/weight_sync/<date>``). Warns when the load average exceeds 0.5 per
core before the run: the figures then measure the neighbours as much as the paths.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PATHS = ("distributed", "tensor", "disk")
MODELS = ("tiny", "qwen3-0.6b-shape")


def machine() -> dict[str, Any]:
    model = ""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                                    timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "nproc": os.cpu_count(), "cpu": model,
            "loadavg_before": os.getloadavg(), "python": platform.python_version(), "git_commit": commit,
            "git_dirty": dirty}


def copy_rate(tensors: dict[str, Any], repeats: int) -> float:
    """Seconds of a plain copy of every tensor into a preallocated one (median of ``repeats``)."""
    import torch

    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    for k, v in tensors.items():  # first touch of the destination pages, outside the timing
        dst[k].copy_(v)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, v in tensors.items():
            dst[k].copy_(v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def time_path(kind: str, url: str, tensors: dict[str, Any], repeats: int, bucket_mb: int, work_dir: str) -> dict[str, Any]:
    from lightning_fasync.rollout.client import SGLangClient
    from lightning_fasync.rollout.weight_sync import make_weight_sync

    client = SGLangClient([url], admin_timeout_s=1800)
    sync = make_weight_sync(kind, client, bucket_bytes=bucket_mb * 2**20, timeout_s=1800, work_dir=work_dir)
    try:
        t0 = time.perf_counter()
        await sync.connect()
        connect = time.perf_counter() - t0
        await sync.push(tensors, 1)  # warm-up: first-touch of buffers, engine-side allocations
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            await sync.push(tensors, 2 + i)
            times.append(time.perf_counter() - t0)
        return {"connect_s": connect, "push_s": statistics.median(times), "push_s_best": min(times)}
    finally:
        await sync.close()


def bench_model(name: str, paths: list[str], repeats: int, bucket_mb: int, threads: int) -> list[dict[str, Any]]:
    import torch

    from lightning_fasync.policy import build_policy
    from lightning_fasync.rollout.launch import launch_server
    from lightning_fasync.rollout.weight_sync import unique_tensors

    model, _ = build_policy(name)
    tensors = unique_tensors({k: v.detach() for k, v in model.state_dict().items()})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = sum(p.numel() for p in model.parameters())
    del model
    copy_s = copy_rate(tensors, max(3, repeats))
    engine = launch_server(name, threads=threads, max_running_requests=1, context_length=64, timeout=900)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="fasync-bench-") as work_dir:
            for kind in paths:
                timing = asyncio.run(time_path(kind, engine.url, tensors, repeats, bucket_mb, work_dir))
                rate = nbytes / timing["push_s"] / 1e9
                rows.append({"model": name, "params_m": round(params / 1e6, 1), "mb": round(nbytes / 2**20, 1), "path": kind,
                             "bucket_mb": bucket_mb, "connect_s": round(timing["connect_s"], 4),
                             "push_s": round(timing["push_s"], 4), "push_s_best": round(timing["push_s_best"], 4),
                             "gb_s": round(rate, 3), "copy_gb_s": round(nbytes / copy_s / 1e9, 3),
                             "ratio": round(rate / (nbytes / copy_s / 1e9), 3)})
                print(f"{name} {kind}: {timing['push_s']:.3f} s ({rate:.2f} GB/s)", file=sys.stderr, flush=True)
    finally:
        engine.stop()
        del tensors
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], repeats: int) -> str:
    load = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        "# Weight sync: seconds and GB/s per path, against a plain copy of the same bytes",
        "",
        f"{meta['date']}; nproc {meta['nproc']}; {meta['cpu']}; load average before {load(meta['loadavg_before'])}, "
        f"after {load(meta['loadavg_after'])}; git {meta['git_commit'][:12]}{' (modified)' if meta['git_dirty'] else ''}",
        "",
        f"One embedded engine process on this host; median of {repeats} pushes after a warm-up. A push is the whole "
        "step-boundary sequence (pause, flush, bracket, buckets, flush, continue), the engine's load included. "
        "`copy GB/s`: a plain in-memory copy of the same tensors in this process; `ratio`: path over copy (target >= 50 %).",
        "",
    ]
    if meta.get("warning"):
        lines += [f"**Warning:** {meta['warning']}", ""]
    lines += [
        "| model | params (M) | MB | path | bucket MB | connect (s) | push (s) | best (s) | GB/s | copy GB/s | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {r['model']} | {r['params_m']} | {r['mb']} | {r['path']} | {r['bucket_mb']} | {r['connect_s']} | "
          f"{r['push_s']} | {r['push_s_best']} | {r['gb_s']} | {r['copy_gb_s']} | {r['ratio']:.0%} |" for r in rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated presets ({', '.join(MODELS)})")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated paths ({', '.join(PATHS)})")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512, help="rollout.weight_sync_bucket_mb")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine process")
    parser.add_argument("--quick", action="store_true", help="tiny only, 2 repeats, 1 MiB buckets: a smoke run")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "weight_sync", time.strftime("%Y-%m-%d")))
    args = parser.parse_args(argv)
    models, repeats, bucket_mb = args.models.split(","), args.repeats, args.bucket_mb
    if args.quick:
        models, repeats, bucket_mb = ["tiny"], 2, 1
    paths = args.paths.split(",")
    unknown = [p for p in paths if p not in PATHS] + [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown path or model: {', '.join(unknown)}")
    meta = machine()
    nproc = meta["nproc"] or 1
    if meta["loadavg_before"][0] > 0.5 * nproc:
        meta["warning"] = (f"the load average before the run was {meta['loadavg_before'][0]:.2f} on {nproc} cores "
                           "(> 0.5 per core): other processes share the machine, so these figures are noisy.")
        print(f"WARNING: {meta['warning']}", file=sys.stderr, flush=True)
    rows = [row for name in models for row in bench_model(name, paths, repeats, bucket_mb, args.threads)]
    meta["loadavg_after"] = os.getloadavg()
    meta.update(models=models, paths=paths, repeats=repeats, bucket_mb=bucket_mb, engine_threads=args.threads)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = markdown(rows, meta, repeats)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(text)
    return rows


if __name__ == "__main__":
    main()

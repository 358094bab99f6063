"""Weight sync: each path's seconds and GB/s against a plain copy of the same bytes, in one run.

For each model (``tiny``, and ``qwen3-0.6b-shape``: Qwen3-0.6B's dimensions, 0.6 B parameters,
random weights in float32 and in bfloat16 (``--dtypes``), on CPU), one embedded engine process is started and the trainer's weights
(this process) are pushed to it ``--repeats`` times over each path of
:mod:`lightning_fasync.rollout.weight_sync`: ``distributed`` (gloo broadcast of flattened buckets),
``tensor`` (SGLang-serialised buckets in shared memory) and ``disk`` (a safetensors directory).
A push is the whole sequence a step boundary runs: pause, flush, bracket, every bucket, flush,
continue; the engine's own load (copy into its parameters, rebuild of its fused matrices) is part
of it. ``distributed`` forms its group once, before the timed pushes (reported as "connect").

Each path is measured against a plain transfer of the same bytes over its own medium, timed in
the same run with the same bucket sizes:

- ``tensor``: an in-memory copy of every tensor into preallocated ones (``copy_``);
- ``distributed``: raw gloo broadcasts of the buckets from this process to a second one (a group
  made as the path makes it, receiving into preallocated buffers);
- ``disk``: the buckets' bytes written to files in the work directory and read back into
  preallocated memory through a memory map (as safetensors loads).

The ratio column is the path's rate over its medium's (target >= 50 %). A push moves the bytes at
least twice (into its bucket, file or socket, then into the engine's parameters), and the engine
then rebuilds the fused matrices of what changed, so 50 % means the path adds little beyond the
copies it cannot avoid. This process runs with ``--trainer-threads`` torch threads (1: the trainer's
share of a 2-core fully-async split) and the engine with ``--threads``; the memory copy is timed at
the trainer's threads too.

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
MEDIA = {"tensor": "memory copy", "distributed": "gloo broadcast", "disk": "file write + read"}
MODELS = ("tiny", "qwen3-0.6b-shape")


def machine() -> dict[str, Any]:
    from _machine import cpu_model, git_state

    model = cpu_model()
    commit, dirty = git_state()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "nproc": os.cpu_count(), "cpu": model,
            "loadavg_before": os.getloadavg(), "python": platform.python_version(), "git_commit": commit,
            "git_dirty": dirty}


def copy_rate(tensors: dict[str, Any], repeats: int) -> float:  # the tensor path's medium
    """Seconds of a plain copy of every tensor into a preallocated one (median of ``repeats``)."""
    import torch

    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    for k, v in tensors.items():  # first touch of the destination pages, outside the timing
        dst[k].copy_(v)
    times = []
    for _ in range(repeats):
        _synchronize()
        t0 = time.perf_counter()
        for k, v in tensors.items():
            dst[k].copy_(v)
        _synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _buckets_bytes(tensors: dict[str, Any], bucket_mb: int) -> list[int]:
    from lightning_fasync.rollout import weight_wire

    return [sum(t.numel() * t.element_size() for _, t in b) for b in weight_wire.plan_buckets(tensors, bucket_mb * 2**20)]


_RECEIVER = r"""
import datetime, sys, torch
sys.path.insert(0, sys.argv[1])
from lightning_fasync.rollout import weight_wire
torch.set_num_threads(1)
port, sizes, rounds = int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4])
pg = weight_wire.init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 1, "bench",
                                           timeout=datetime.timedelta(seconds=600))
bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
for _ in range(rounds):
    for b in bufs:
        torch.distributed.broadcast(b, src=0, group=pg)
weight_wire.destroy_process_group(pg)
"""


def gloo_rate(sizes: list[int], repeats: int) -> float:
    """Seconds of raw gloo broadcasts of ``sizes`` bytes from this process to a receiving process
    (median of ``repeats``; the distributed path's medium)."""
    import datetime

    import torch

    from lightning_fasync.rollout import weight_wire
    from lightning_fasync.rollout.launch import free_port

    port = free_port()
    rounds = 1 + repeats
    receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, REPO, str(port), ",".join(map(str, sizes)), str(rounds)])
    try:
        pg = weight_wire.init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "bench",
                                                   timeout=datetime.timedelta(seconds=600))
        bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for b in bufs:
                torch.distributed.broadcast(b, src=0, group=pg)
            times.append(time.perf_counter() - t0)
        weight_wire.destroy_process_group(pg)
        receiver.wait(timeout=120)
        return statistics.median(times[1:])
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


def file_rate(tensors: dict[str, Any], bucket_mb: int, repeats: int, work_dir: str) -> float:
    """Seconds to write the buckets' bytes to files in ``work_dir`` and read them back into
    preallocated memory through a memory map (median of ``repeats``; the disk path's medium)."""
    import torch

    from lightning_fasync.rollout import weight_wire

    buckets = weight_wire.plan_buckets(tensors, bucket_mb * 2**20)
    srcs = [torch.cat([t.reshape(-1).view(torch.uint8) for _, t in b]).cpu() for b in buckets]
    dsts = [torch.empty_like(x) for x in srcs]
    import numpy as np

    times = []
    for _ in range(1 + repeats):
        paths = [os.path.join(work_dir, f"medium-{i}.bin") for i in range(len(srcs))]
        t0 = time.perf_counter()
        for path, src, dst in zip(paths, srcs, dsts):
            with open(path, "wb") as f:
                f.write(src.numpy().data)
            # Read back through a memory map, as safetensors loads a shard: one copy from the page cache.
            dst.copy_(torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", shape=(dst.numel(),))))
        times.append(time.perf_counter() - t0)
        for path in paths:
            os.remove(path)
    return statistics.median(times[1:])


async def time_path(kind: str, url: str, tensors: dict[str, Any], repeats: int, bucket_mb: int, work_dir: str) -> dict[str, Any]:
    from lightning_fasync.rollout.client import SGLangClient
    from lightning_fasync.rollout.weight_sync import make_weight_sync

    client = SGLangClient([url], admin_timeout_s=1800)
    sync = make_weight_sync(kind, client, bucket_bytes=bucket_mb * 2**20, timeout_s=1800, work_dir=work_dir)
    try:
        t0 = time.perf_counter()
        await sync.connect()
        connect = time.perf_counter() - t0
        # Warm-up, reported apart: first touch of buffers, engine-side allocations, and (zero-copy
        # tensor path) the trainer's tensors moving into shared memory, once per run.
        t0 = time.perf_counter()
        await sync.push(tensors, 1)
        first = time.perf_counter() - t0
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            await sync.push(tensors, 2 + i)
            times.append(time.perf_counter() - t0)
        return {"connect_s": connect, "first_s": first, "push_s": statistics.median(times), "push_s_best": min(times),
                "push_s_worst": max(times)}
    finally:
        await sync.close()


def bench_model(name: str, paths: list[str], repeats: int, bucket_mb: int, threads: int,
                dtype: str = "float32", device: str = "cpu") -> list[dict[str, Any]]:
    import torch

    from lightning_fasync.policy import build_policy
    from lightning_fasync.rollout.launch import launch_server
    from lightning_fasync.rollout.weight_sync import unique_tensors

    model, _ = build_policy(name, getattr(torch, dtype))
    model.to(device)
    tensors = unique_tensors({k: v.detach() for k, v in model.state_dict().items()})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = sum(p.numel() for p in model.parameters())
    del model
    copy_s = copy_rate(tensors, max(3, repeats))
    rows = []
    with tempfile.TemporaryDirectory(prefix="fasync-bench-") as work_dir:
        medium_s = {"tensor": copy_s}
        if "distributed" in paths:
            medium_s["distributed"] = gloo_rate(_buckets_bytes(tensors, bucket_mb), max(3, repeats))
        if "disk" in paths:
            medium_s["disk"] = file_rate(tensors, bucket_mb, max(3, repeats), work_dir)
        engine = launch_server(name, threads=threads, max_running_requests=1, context_length=64, timeout=900,
                               extra_args=["--dtype", dtype, "--device", device])
        try:
            for kind in paths:
                timing = asyncio.run(time_path(kind, engine.url, tensors, repeats, bucket_mb, work_dir))
                rate = nbytes / timing["push_s"] / 1e9
                medium = nbytes / medium_s[kind] / 1e9
                rows.append({"model": name, "dtype": dtype, "params_m": round(params / 1e6, 1), "mb": round(nbytes / 2**20, 1),
                             "path": kind, "bucket_mb": bucket_mb, "connect_s": round(timing["connect_s"], 4), "first_s": round(timing["first_s"], 4),
                             "push_s": round(timing["push_s"], 4), "push_s_best": round(timing["push_s_best"], 4),
                             "push_s_worst": round(timing["push_s_worst"], 4),
                             "gb_s": round(rate, 3), "medium": MEDIA[kind], "medium_gb_s": round(medium, 3),
                             "ratio": round(rate / medium, 3), "copy_gb_s": round(nbytes / copy_s / 1e9, 3)})
                print(f"{name} {dtype} {kind}: {timing['push_s']:.3f} s ({rate:.2f} GB/s; {MEDIA[kind]} {medium:.2f} GB/s)",
                      file=sys.stderr, flush=True)
        finally:
            engine.stop()
    del tensors
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], repeats: int) -> str:
    load = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        "# Weight sync: seconds and GB/s per path, against a plain transfer of the same bytes over its medium",
        "",
        f"{meta['date']}; device {meta['device']}; nproc {meta['nproc']}; {meta['cpu']}; load average before {load(meta['loadavg_before'])}, "
        f"after {load(meta['loadavg_after'])}; git {meta['git_commit'][:12]}{' (modified)' if meta['git_dirty'] else ''}",
        "",
        f"One embedded engine process on this host; median of {repeats} pushes after a warm-up push (`first push`: "
        "first touch of buffers, and the zero-copy tensor path moving the trainer's tensors into shared memory, once "
        "per run). A push is the whole "
        "step-boundary sequence (pause, flush, bracket, buckets, flush, continue), the engine's load included. "
        "`medium GB/s`: a plain transfer of the same bytes in the same buckets over the path's own medium; `ratio`: "
        "path over medium (target >= 50 %); `copy GB/s`: an in-memory copy, for scale. "
        f"Trainer (this process) {meta['trainer_threads']} torch thread(s), engine {meta['engine_threads']}.",
        "",
    ]
    if meta.get("warning"):
        lines += [f"**Warning:** {meta['warning']}", ""]
    lines += [
        "| model | dtype | params (M) | MB | path | bucket MB | connect (s) | first push (s) | push (s), median | range (s) | GB/s | medium | medium GB/s "
        "| ratio | copy GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {r['model']} | {r['dtype']} | {r['params_m']} | {r['mb']} | {r['path']} | {r['bucket_mb']} | {r['connect_s']} | {r['first_s']} | "
          f"{r['push_s']} | {r['push_s_best']}-{r['push_s_worst']} | {r['gb_s']} | {r['medium']} | {r['medium_gb_s']} | {r['ratio']:.0%} | "
          f"{r['copy_gb_s']} |" for r in rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated presets ({', '.join(MODELS)})")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated paths ({', '.join(PATHS)})")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated parameter dtypes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512, help="rollout.weight_sync_bucket_mb")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine process")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: trainer tensors and engine on the GPU "
                        "(distributed needs a second device for NCCL and is skipped on one)")
    parser.add_argument("--trainer-threads", type=int, default=1,
                        help="torch threads of this process (the trainer's side; 1 in a 2-core fully-async split)")
    parser.add_argument("--quick", action="store_true", help="tiny only, 2 repeats, 1 MiB buckets: a smoke run")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "weight_sync", time.strftime("%Y-%m-%d")))
    args = parser.parse_args(argv)
    models, repeats, bucket_mb, dtypes = args.models.split(","), args.repeats, args.bucket_mb, args.dtypes.split(",")
    if args.quick:
        models, repeats, bucket_mb, dtypes = ["tiny"], 2, 1, ["float32"]
    paths = args.paths.split(",")
    unknown = ([p for p in paths if p not in PATHS] + [m for m in models if m not in MODELS]
               + [d for d in dtypes if d not in ("float32", "bfloat16", "float16")])
    if unknown:
        parser.error(f"unknown path or model: {', '.join(unknown)}")
    import torch

    torch.set_num_threads(args.trainer_threads)
    meta = machine()
    meta["device"] = args.device if args.device == "cpu" else f"{args.device} ({torch.cuda.get_device_name()})"
    nproc = meta["nproc"] or 1
    if meta["loadavg_before"][0] > 0.5 * nproc:
        meta["warning"] = (f"the load average before the run was {meta['loadavg_before'][0]:.2f} on {nproc} cores "
                           "(> 0.5 per core): other processes share the machine, so these figures are noisy.")
        print(f"WARNING: {meta['warning']}", file=sys.stderr, flush=True)
    if args.device != "cpu" and "distributed" in paths:
        # NCCL refuses two ranks on one device: the trainer and the engine would both be on it.
        print("distributed skipped: NCCL needs the trainer and the engine on different devices", file=sys.stderr)
        paths = [p for p in paths if p != "distributed"]
    rows = [row for name in models for dtype in (dtypes if name != "tiny" else ["float32"])
            for row in bench_model(name, paths, repeats, bucket_mb, args.threads, dtype, args.device)]
    meta["loadavg_after"] = os.getloadavg()
    meta.update(models=models, dtypes=dtypes, paths=paths, repeats=repeats, bucket_mb=bucket_mb, engine_threads=args.threads,
                trainer_threads=args.trainer_threads)
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

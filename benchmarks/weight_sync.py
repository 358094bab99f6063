"""Weight sync: each path's seconds and GB/s against a plain copy of the same bytes, in one run.

For each model (``tiny``, and ``qwen3-0.6b-shape``: Qwen3-0.6B's dimensions, 0.6 B parameters,
random weights in float32 and in bfloat16 (``--dtypes``), on CPU), one embedded engine process is started and the trainer's weights
(this process) are pushed to it ``--repeats`` times over each path of
:mod:`lightning_fasync.weights.sync`: ``distributed`` (gloo broadcast of flattened buckets),
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

Sharded trainer (``--sharded``, on by default; ``--no-sharded`` leaves it out): the same weights
pushed to the same engine from a policy sharded with FSDP2 over 2 CPU processes on gloo
(``shard_policy`` on a ``(2, 1)`` mesh, as ``ModelParallelStrategy(data_parallel_size=2)``; each rank
``--trainer-threads`` torch threads), against this process's push, over each of ``--sharded-paths``
(``tensor`` and ``distributed`` by default). The ranks (``benchmarks/_shard_ranks.py``) build the
seeded preset in turn (no full model in this process for them) and stay up for every push of a
model and dtype; every rank gathers one tensor at a time (``full_tensor_stream``), rank 0 pushes the
stream and rank 1 drains its own, as a sharded step boundary does. ``same weights``: the SHA-256 of
every tensor the ranks' stream delivers equals this process's. Per path, the two trainers push in
alternation (single, sharded, sharded, single, ...), one warm-up each and then ``--repeats`` timed.
Reported: the push (median, range), the gathers' share of it (rank 0's time inside
``DTensor.full_tensor()``), and memory from ``/proc/self/status``: each process's resident set
before the path's first push, the peak over it during any push (``VmHWM`` reset before each), and
what stays after; rank 0's peak extra is set against "one bucket plus one tensor" (the stream's
largest bucket plus its largest tensor), the bound ``docs/weight_sync.md`` claims.

    python benchmarks/weight_sync.py                 # both models, every path, sharded (minutes; 2 x 2.4 GB for 0.6B)
    python benchmarks/weight_sync.py --quick         # tiny only, a smoke run (sharded section included)
    python benchmarks/weight_sync.py --models tiny --paths tensor,disk --repeats 5

Prints Markdown tables; writes ``results.csv`` (the paths), ``sharded.csv`` (the sharded section),
``results.md`` and ``meta.json`` (nproc, CPU model, load average before and after, date, git commit) to ``--out``
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
from typing import Any, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from _shard_ranks import PeakRss, ShardedTrainer, rss_bytes  # noqa: E402 - beside this file

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
    from lightning_fasync.weights import wire as weight_wire

    return [sum(t.numel() * t.element_size() for _, t in b) for b in weight_wire.plan_buckets(tensors, bucket_mb * 2**20)]


_RECEIVER = r"""
import datetime, sys, torch
sys.path.insert(0, sys.argv[1])
from lightning_fasync.weights import wire as weight_wire
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

    from lightning_fasync.weights import wire as weight_wire
    from lightning_fasync.fleet.launch import free_port

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

    from lightning_fasync.weights import wire as weight_wire

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
    from lightning_fasync.fleet.client import SGLangClient
    from lightning_fasync.weights.sync import make_weight_sync

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
                dtype: str = "float32", device: str = "cpu", sharded_paths: Sequence[str] = (),
                trainer_threads: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One engine for ``name`` in ``dtype``: the rows of each path, then (with ``sharded_paths``)
    those of the sharded section, against the same engine."""
    import torch

    from lightning_fasync.policy import build_policy
    from lightning_fasync.fleet.launch import launch_server
    from lightning_fasync.weights.sync import unique_tensors

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
            common = {"model": name, "dtype": dtype, "params_m": round(params / 1e6, 1), "mb": round(nbytes / 2**20, 1),
                      "bucket_mb": bucket_mb}
            sharded = (bench_sharded(common, tensors, engine.url, list(sharded_paths), repeats, trainer_threads, work_dir)
                       if sharded_paths else [])
        finally:
            engine.stop()
    del tensors
    return rows, sharded


SHARDED = "FSDP2 dp=2 (gloo)"  # the sharded trainer's label in the rows


def _mb(nbytes: float) -> float:
    return round(nbytes / 2**20, 2)


def bench_sharded(common: dict[str, Any], tensors: dict[str, Any], url: str, kinds: list[str], repeats: int,
                  trainer_threads: int, work_dir: str) -> list[dict[str, Any]]:
    """The sharded section for one model and dtype (module docstring): per path in ``kinds``, a row
    for this process's push of ``tensors`` and one for the 2-rank FSDP2 trainer's, to ``url``."""
    from lightning_fasync.fleet.client import SGLangClient
    from lightning_fasync.weights.checksum import checksums
    from lightning_fasync.weights.sync import make_weight_sync

    bucket = common["bucket_mb"] * 2**20
    rows = []
    version = 1000
    with ShardedTrainer(common["model"], common["dtype"], threads=trainer_threads, bucket_bytes=bucket,
                        timeout_s=1800, work_dir=work_dir) as ranks:
        same = ranks.ask("checksums")[0] == checksums(tensors)
        bound_bucket, largest = ranks.ready[0]["bucket_bytes"], ranks.ready[0]["largest_tensor_bytes"]
        for kind in kinds:
            loop = asyncio.new_event_loop()  # one loop for the single process's pushes: its sync lives on it
            single = make_weight_sync(kind, SGLangClient([url], admin_timeout_s=1800), bucket_bytes=bucket, timeout_s=1800,
                                      work_dir=work_dir)
            try:
                loop.run_until_complete(single.connect())
                opened = [r["rss"] for r in ranks.ask("open", kind, url)]
                base = rss_bytes()
                times: dict[str, list[float]] = {"single": [], "sharded": []}
                first: dict[str, float] = {}
                gathers: list[float] = []
                peak, after = [base, *opened], [base, *opened]  # this process, rank 0, rank 1
                for i in range(1 + repeats):  # the first push of each is the warm-up; then in alternation
                    for trainer in ("single", "sharded") if i % 2 == 0 else ("sharded", "single"):
                        version += 1
                        if trainer == "single":
                            with PeakRss() as mem:
                                t0 = time.perf_counter()
                                loop.run_until_complete(single.push(tensors, version))
                                seconds = time.perf_counter() - t0
                            peak[0], after[0] = max(peak[0], mem.peak), rss_bytes()
                        else:
                            answers = ranks.ask("push", kind, version)
                            seconds = answers[0]["push_s"]
                            for r, answer in enumerate(answers):
                                peak[1 + r], after[1 + r] = max(peak[1 + r], answer["peak"]), answer["rss_after"]
                            if i:
                                gathers.append(answers[0]["gather_s"])
                        if i:
                            times[trainer].append(seconds)
                        else:
                            first[trainer] = seconds
                ranks.ask("close", kind)
            finally:
                loop.run_until_complete(single.close())
                loop.close()
            for trainer in ("single", "sharded"):
                push_s = statistics.median(times[trainer])
                row = {**common, "path": kind, "trainer": "single process" if trainer == "single" else SHARDED,
                       "first_s": round(first[trainer], 4), "push_s": round(push_s, 4),
                       "push_s_best": round(min(times[trainer]), 4), "push_s_worst": round(max(times[trainer]), 4),
                       "gather_s": None, "gather_share": None, "rss_mb": _mb(base), "rss1_mb": None,
                       "peak_extra_mb": _mb(peak[0] - base), "peak_extra1_mb": None, "held_mb": _mb(after[0] - base),
                       "bucket_max_mb": None, "largest_tensor_mb": None, "bound_mb": None, "peak_over_bound": None,
                       "same_weights": None}
                if trainer == "sharded":
                    gather_s = statistics.median(gathers)
                    row.update(gather_s=round(gather_s, 4), gather_share=round(gather_s / push_s, 3), rss_mb=_mb(opened[0]),
                               rss1_mb=_mb(opened[1]), peak_extra_mb=_mb(peak[1] - opened[0]),
                               peak_extra1_mb=_mb(peak[2] - opened[1]), held_mb=_mb(after[1] - opened[0]),
                               bucket_max_mb=_mb(bound_bucket), largest_tensor_mb=_mb(largest),
                               bound_mb=_mb(bound_bucket + largest),
                               peak_over_bound=round((peak[1] - opened[0]) / (bound_bucket + largest), 3), same_weights=same)
                rows.append(row)
            print(f"{common['model']} {common['dtype']} {kind}: single {rows[-2]['push_s']:.3f} s, sharded "
                  f"{rows[-1]['push_s']:.3f} s (gather {rows[-1]['gather_s']:.3f} s); rank 0 peak extra "
                  f"{rows[-1]['peak_extra_mb']} MB of a {rows[-1]['bound_mb']} MB bound", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], repeats: int,
             sharded: Sequence[dict[str, Any]] = ()) -> str:
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
    if sharded:
        lines += ["", *sharded_markdown(sharded, meta)]
    return "\n".join(lines) + "\n"


def _bound_cell(row: dict[str, Any]) -> str:
    if row["bound_mb"] is None:
        return "–"
    return f"{row['bound_mb']} ({row['bucket_max_mb']} + {row['largest_tensor_mb']})"


def sharded_markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """The sharded section's lines: what was measured, then one row per trainer, path, model, dtype."""
    info = meta["sharded"]
    cell = lambda v: "–" if v is None else v  # noqa: E731
    pair = lambda a, b: f"{a} / {b}" if b is not None else f"{a}"  # noqa: E731
    return [
        "## Sharded trainer against a single process: the same weights to the same engine",
        "",
        f"The policy sharded with FSDP2 over {info['world']} CPU processes on gloo (`shard_policy` on a "
        f"({info['world']}, 1) mesh, as `ModelParallelStrategy(data_parallel_size={info['world']})`), each rank "
        f"{meta['trainer_threads']} torch thread(s) as this process: every rank gathers one tensor at a time "
        "(`full_tensor_stream`), rank 0 pushes the stream (flattened buckets) and rank 1 drains its own. The single "
        "process pushes its mapping as the table above does (`tensor`: zero-copy handles to its shared-memory "
        "tensors; `distributed`: one broadcast per tensor). Per path, the two push in alternation (single, sharded, "
        f"sharded, single, ...) to the same engine: median of {meta['repeats']} after one warm-up each (`first push`). "
        "`gather`: rank 0's seconds inside `DTensor.full_tensor()`, and its share of the push. `same weights`: the "
        "SHA-256 of every tensor the ranks' stream delivers equals this process's. Memory (MiB, from "
        f"/proc/self/status, {info['rss_method']}): `resident` before the path's first push (rank 0 / rank 1, or "
        "this process: its model, the runtime, what earlier tables left), `peak extra` the highest resident set over "
        "it during any push, the warm-up included (the staging bucket is allocated there), `held` what stays after "
        "the last push. `bound`: one bucket plus one tensor (the stream's largest bucket plus its largest tensor), "
        "what rank 0's peak extra is claimed to stay within; `peak / bound` checks it. Resident memory does not see "
        "what the allocator serves from pages a process already holds.",
        "",
        "| model | dtype | path | trainer | first push (s) | push (s), median | range (s) | gather (s), median | "
        "gather share | resident MiB | peak extra MiB | held MiB | bound MiB (bucket + tensor) | peak / bound | same weights |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {r['model']} | {r['dtype']} | {r['path']} | {r['trainer']} | {r['first_s']} | {r['push_s']} | "
          f"{r['push_s_best']}-{r['push_s_worst']} | {cell(r['gather_s'])} | "
          f"{'–' if r['gather_share'] is None else format(r['gather_share'], '.0%')} | {pair(r['rss_mb'], r['rss1_mb'])} | "
          f"{pair(r['peak_extra_mb'], r['peak_extra1_mb'])} | {r['held_mb']} | "
          f"{_bound_cell(r)} | "
          f"{'–' if r['peak_over_bound'] is None else format(r['peak_over_bound'], '.0%')} | "
          f"{'–' if r['same_weights'] is None else ('yes' if r['same_weights'] else '**no**')} |" for r in rows),
    ]


def main(argv: Optional[list[str]] = None) -> dict[str, list[dict[str, Any]]]:
    """Run the benchmark; returns its rows: ``{"paths": [...], "sharded": [...]}``."""
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
    parser.add_argument("--sharded", action=argparse.BooleanOptionalAction, default=True,
                        help="the sharded section: an FSDP2 trainer over 2 CPU processes against this one (on by default)")
    parser.add_argument("--sharded-paths", default="tensor,distributed",
                        help=f"comma-separated paths the sharded section pushes over ({', '.join(PATHS)})")
    parser.add_argument("--quick", action="store_true", help="tiny only, 2 repeats, 1 MiB buckets: a smoke run "
                        "(with the sharded section unless --no-sharded)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "weight_sync", time.strftime("%Y-%m-%d")))
    args = parser.parse_args(argv)
    models, repeats, bucket_mb, dtypes = args.models.split(","), args.repeats, args.bucket_mb, args.dtypes.split(",")
    if args.quick:
        models, repeats, bucket_mb, dtypes = ["tiny"], 2, 1, ["float32"]
    paths = args.paths.split(",")
    sharded_paths = args.sharded_paths.split(",") if args.sharded else []
    unknown = ([p for p in paths + sharded_paths if p not in PATHS] + [m for m in models if m not in MODELS]
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
    if args.device != "cpu" and sharded_paths:
        # The ranks are CPU processes on gloo; a sharded trainer on GPUs needs one GPU per rank.
        print("sharded section skipped: its ranks run on CPU (gloo)", file=sys.stderr)
        sharded_paths = []
    rows, sharded = [], []
    for name in models:
        for dtype in dtypes if name != "tiny" else ["float32"]:
            model_rows, model_sharded = bench_model(name, paths, repeats, bucket_mb, args.threads, dtype, args.device,
                                                    sharded_paths, args.trainer_threads)
            rows += model_rows
            sharded += model_sharded
    meta["loadavg_after"] = os.getloadavg()
    meta.update(models=models, dtypes=dtypes, paths=paths, repeats=repeats, bucket_mb=bucket_mb, engine_threads=args.threads,
                trainer_threads=args.trainer_threads)
    if sharded:
        with PeakRss() as probe:  # how this machine gives peaks (the ranks read them the same way)
            pass
        meta["sharded"] = {"world": 2, "strategy": "FSDP2 (fully_shard per decoder layer and root), data_parallel_size=2, "
                           "gloo, CPU", "paths": sharded_paths, "rank_threads": args.trainer_threads,
                           "rss_method": f"{probe.method} reset before each push" if probe.method == "VmHWM"
                           else f"{probe.method} every 2 ms"}
    os.makedirs(args.out, exist_ok=True)
    for file, table in (("results.csv", rows), ("sharded.csv", sharded)):
        if table:
            with open(os.path.join(args.out, file), "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(table[0]))
                writer.writeheader()
                writer.writerows(table)
    text = markdown(rows, meta, repeats, sharded)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(text)
    return {"paths": rows, "sharded": sharded}


if __name__ == "__main__":
    main()

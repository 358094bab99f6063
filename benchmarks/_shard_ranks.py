"""The sharded trainer that ``benchmarks/weight_sync.py`` sets against its single-process one.

``world`` spawned processes on gloo (127.0.0.1) each build the same seeded preset, in turn (one full
model in memory at a time, none in the parent), and shard it with
:func:`~lightning_fasync.trainers.fsdp.sharding.shard_policy` over a ``(world, 1)`` mesh: FSDP2 over the
``data_parallel`` dim, as ``ModelParallelStrategy(data_parallel_size=world)`` does. They stay up for
every push of one model and dtype, each driven by the parent over its own pipe, and are stopped by
pid. A push is what a sharded trainer's step boundary runs: every rank builds
:func:`~lightning_fasync.weights.shard_gather.full_tensor_stream`; rank 0 hands it to its
:class:`~lightning_fasync.weights.sync.WeightSync`, which gathers one tensor at a time into
its bucket, and the others drain theirs. Rank 0 times the gathers (``DTensor.full_tensor()`` calls)
apart from the push that contains them.

Memory is read from ``/proc/self/status`` (Linux): a push's peak is ``VmHWM`` after resetting the
mark (``/proc/self/clear_refs``), else the largest ``VmRSS`` sampled every 2 ms on a thread. It is
resident memory, so what the allocator serves from pages the process already holds is not counted.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Optional


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its high-water mark (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}.")


class PeakRss:
    """The peak resident memory of this process while the ``with`` block runs.

    ``before``: ``VmRSS`` on entry; ``peak``: the highest resident size inside the block (bytes).
    """

    def __init__(self) -> None:
        self.before = self.peak = 0
        self.method = "VmHWM"
        self._stop = threading.Event()
        self._sampler: Optional[threading.Thread] = None

    def __enter__(self) -> "PeakRss":
        self.before = self.peak = rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
        except OSError:
            self.method = "sampled VmRSS"
            self._sampler = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: Any) -> None:
        if self._sampler is None:
            self.peak = max(self.peak, rss_bytes("VmHWM"))
            return
        self._stop.set()
        self._sampler.join(timeout=5)
        self.peak = max(self.peak, rss_bytes())


def stream_bound(specs: Any, bucket_bytes: int) -> tuple[int, int]:
    """``(largest bucket, largest tensor)`` in bytes of a stream with ``specs`` pushed in buckets of
    at most ``bucket_bytes``, planned by the weight sync's own rule (a larger tensor goes alone)."""
    from lightning_fasync.weights import wire as weight_wire

    sizes = [(s.nbytes, s.dtype.itemsize) for s in specs]
    buckets = [specs[r.start : r.stop] for r in weight_wire.plan_ranges(sizes, bucket_bytes)]
    largest_bucket = max(weight_wire.bucket_bytes(weight_wire.layout([s.name for s in b], [s.dtype for s in b],
                                                                     [s.shape for s in b])) for b in buckets)
    return largest_bucket, max(s.nbytes for s in specs)


def _timed(stream: Any) -> tuple[Any, list[float]]:
    """``stream`` as a new stream whose takes (the gathers) add their seconds to the returned cell."""
    from lightning_fasync.weights.tensor_stream import TensorStream

    spent = [0.0]

    def produce(i: int) -> Any:
        t0 = time.perf_counter()
        _, tensor = stream.take()
        spent[0] += time.perf_counter() - t0
        return tensor

    return TensorStream(stream.specs, produce), spent


def _rank_main(rank: int, world: int, port: int, conn: Any, spec: dict[str, Any]) -> None:
    """One rank: build and shard, answer ``ready``, then serve the parent's commands until ``stop``
    (or until the parent's end of the pipe closes)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    loop: Optional[asyncio.AbstractEventLoop] = None
    syncs: dict[str, Any] = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_fasync.weights.shard_gather import full_tensor_stream
        from lightning_fasync.trainers.fsdp.sharding import shard_policy
        from lightning_fasync.policy import build_policy

        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=spec["timeout_s"]))
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        policy = None
        for turn in range(world):  # in turn: one full model at a time on this host
            if turn == rank:
                policy, _ = build_policy(spec["model"], getattr(torch, spec["dtype"]))
                shard_policy(policy, mesh)
                gc.collect()
            dist.barrier()
        bucket, largest = stream_bound(full_tensor_stream(policy).specs, spec["bucket_bytes"])
        conn.send(("ok", {"rss": rss_bytes(), "bucket_bytes": bucket, "largest_tensor_bytes": largest}))
        if rank == 0:
            loop = asyncio.new_event_loop()
        while True:
            try:
                cmd, *args = conn.recv()
            except EOFError:  # the parent is gone
                return
            if cmd == "stop":
                conn.send(("ok", None))
                return
            conn.send(("ok", _serve(rank, cmd, args, policy, loop, syncs, spec, full_tensor_stream)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if loop is not None:
            for sync in syncs.values():
                try:
                    loop.run_until_complete(asyncio.wait_for(sync.close(), 30))
                except Exception:  # noqa: BLE001 - best effort at exit
                    pass
            loop.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(rank: int, cmd: str, args: list[Any], policy: Any, loop: Any, syncs: dict[str, Any],
           spec: dict[str, Any], full_tensor_stream: Any) -> Any:
    """One command of the parent; returns the answer (rank 0 alone talks to the engine)."""
    if cmd == "open":  # the path's WeightSync (and, for distributed, its group) before anything is measured
        kind, url = args
        if rank == 0:
            from lightning_fasync.fleet.client import SGLangClient
            from lightning_fasync.weights.sync import make_weight_sync

            sync = make_weight_sync(kind, SGLangClient([url], admin_timeout_s=spec["timeout_s"]),
                                    bucket_bytes=spec["bucket_bytes"], timeout_s=spec["timeout_s"],
                                    work_dir=spec["work_dir"])
            loop.run_until_complete(sync.connect())
            syncs[kind] = sync
        gc.collect()
        return {"rss": rss_bytes()}
    if cmd == "close":  # drops the path's staging bucket with it
        if rank == 0:
            loop.run_until_complete(syncs.pop(args[0]).close())
        gc.collect()
        return {"rss": rss_bytes()}
    if cmd == "push":
        kind, version = args
        stream = full_tensor_stream(policy)
        spent = [0.0]
        with PeakRss() as mem:
            t0 = time.perf_counter()
            if rank == 0:
                timed, spent = _timed(stream)
                try:
                    loop.run_until_complete(syncs[kind].push(timed, version))
                finally:
                    timed.drain()  # the other ranks' gathers need this rank's part whatever happened
            else:
                stream.drain()
            elapsed = time.perf_counter() - t0
        return {"push_s": elapsed, "gather_s": spent[0], "rss_before": mem.before, "peak": mem.peak,
                "rss_after": rss_bytes(), "method": mem.method}
    if cmd == "checksums":  # what the stream delivers, hashed as the engines hash their weights
        from lightning_fasync.weights.checksum import tensor_checksum

        stream = full_tensor_stream(policy)
        if rank != 0:
            stream.drain()
            return None
        sums = {}
        for name, tensor in stream:
            sums[name] = tensor_checksum(tensor)
            del tensor
        return sums
    raise ValueError(f"Unknown command {cmd!r}.")


class ShardedTrainer:
    """``world`` rank processes holding ``model`` (a preset) in ``dtype``, sharded by FSDP2.

    Arguments:
        threads: torch threads of each rank.
        bucket_bytes: rank 0's weight-sync bucket size.
        timeout_s: the longest any one command (a push, the build) may take.
        work_dir: where a ``disk`` push writes.
    """

    def __init__(self, model: str, dtype: str, *, world: int = 2, threads: int = 1, bucket_bytes: int,
                 timeout_s: float = 1800.0, work_dir: Optional[str] = None) -> None:
        self.world = world
        self.timeout_s = timeout_s
        self.spec = {"model": model, "dtype": dtype, "threads": threads, "bucket_bytes": bucket_bytes,
                     "timeout_s": timeout_s, "work_dir": work_dir}
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.ready: list[dict[str, Any]] = []

    def start(self) -> "ShardedTrainer":
        """Spawn the ranks and wait until each has built and sharded its model."""
        from lightning_fasync.fleet.launch import free_port

        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:  # a spawned rank imports this module by name, with this sys.path
            sys.path.append(here)
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        try:
            for rank in range(self.world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(rank, self.world, port, child, self.spec),
                                   name=f"sharded-rank-{rank}")
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            self.ready = [self._answer(r, "start (build and shard)") for r in range(self.world)]
        except BaseException:
            self.stop()
            raise
        return self

    def ask(self, *cmd: Any) -> list[Any]:
        """Send ``cmd`` to every rank; their answers, in rank order."""
        for conn in self.conns:
            conn.send(cmd)
        return [self._answer(r, repr(cmd[0])) for r in range(self.world)]

    def _answer(self, rank: int, what: str) -> Any:
        conn, proc = self.conns[rank], self.procs[rank]
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(1.0):
            if not proc.is_alive():
                raise RuntimeError(f"The sharded trainer's rank {rank} exited (code {proc.exitcode}) during {what}.")
            if time.monotonic() > deadline:
                raise TimeoutError(f"The sharded trainer's rank {rank} did not answer {what} within {self.timeout_s:g} s.")
        try:
            status, value = conn.recv()
        except EOFError:
            raise RuntimeError(f"The sharded trainer's rank {rank} exited during {what}.") from None
        if status != "ok":
            raise RuntimeError(f"The sharded trainer's rank {rank} failed during {what}:\n{value}")
        return value

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the ranks to leave, then kill by pid those still alive after ``timeout_s``. Idempotent.

        Polled, never joined: rank 0's shared-memory buckets start torch's shm manager, which keeps
        a copy of the process sentinel that ``join()`` waits on open after the rank has exited."""
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def __enter__(self) -> "ShardedTrainer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

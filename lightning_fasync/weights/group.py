"""The ``distributed`` weight-sync path: SGLang's weight-update group from trainer global rank 0 to
every engine TP rank (docs/weight_sync.md). The interface, the other paths and what they share are in
:mod:`~lightning_fasync.weights.sync`; the group itself is created as SGLang's
``init_custom_process_group`` creates it (:mod:`~lightning_fasync.weights.wire`).

The group is formed once and again only when the serving engines change (or after a collective
failed): the ``/init_weights_update_group`` calls go out to every engine at once while rank 0
creates its side. Each bucket is one ``/update_weights_from_distributed`` call per engine and one
broadcast per tensor straight from the trainer's tensors (or, with ``flatten``, one ``uint8``
broadcast of a flattened bucket), issued on the caller's thread with ``async_op=True``; the answers
and the broadcasts are awaited together, each bounded by the push's timeout. A ``TensorStream``
always goes as flattened buckets, each filled from the stream just before it is broadcast.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import socket
import time
import uuid
from typing import Any, Optional, Sequence
from urllib.parse import urlparse

import torch

from lightning_fasync.weights import wire as weight_wire
from lightning_fasync.pipeline.engine_client import SKIPPED
from lightning_fasync.registry import WeightPath
from lightning_fasync.weights.sync import (
    Bucket, KeptWeights, Weights, WeightSyncError, _BucketedSync, _label, _Streamed, _where,
)


class DistributedWeightSync(_BucketedSync):
    """``distributed``: SGLang's weight-update group (module docstring).

    Arguments:
        master_address: the address engines reach this process at; None: 127.0.0.1 when every
            engine is on this host, else this host's address on the route to the first engine.
        device: where the buckets are broadcast from (NCCL for CUDA, gloo otherwise); None: the
            device of the first tensor pushed.
        flatten: one ``uint8`` broadcast per bucket (``load_format="flattened_bucket"``, a staging
            copy on this side) instead of one broadcast per tensor straight from the tensors (the
            default, as slime sends them; the embedded engine then receives into its parameters).
            A ``TensorStream`` always goes flattened: its tensors are taken one at a time.
    """

    kind = "distributed"

    def __init__(self, *args: Any, master_address: Optional[str] = None, device: Any = None, flatten: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flatten = flatten
        self.master_address = master_address
        self.device = torch.device(device) if device is not None else None
        self.group: Any = None
        self.group_name: Optional[str] = None
        self.members: list[str] = []
        self._socket: Optional[socket.socket] = None
        self._leaked: list[tuple[Any, socket.socket]] = []  # broken groups and their store sockets, kept as they are
        self._broken = False  # a collective of the group failed: abandon it, do not destroy it
        self._changes = -1  # the serving set's change count when the group formed

    async def connect(self) -> None:
        """Form the group with every serving engine (again, when the serving set changed)."""
        urls = self.client.worker_urls
        changes = self.client.workers.changes  # a replica restarted on its URL is a new member
        if self.group is not None and urls == self.members and changes == self._changes and not self._broken:
            return
        await self._disband()
        if not urls:  # none serves (a supervisor is restarting them): the push only keeps the weights
            return
        device = self.device or torch.device("cpu")
        sizes = await self.tp_sizes(urls)
        world = 1 + sum(sizes)
        host = self.master_address or _master_address(urls)
        listen = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        port = listen.getsockname()[1]
        name = f"fasync-weights-{uuid.uuid4().hex[:12]}"
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=self.timeout_s)

        def create() -> Any:
            # Rank 0 serves the rendezvous store on its own 127.0.0.1 (or routable) socket, then
            # joins the group: both wait for every engine, so this runs off the event loop while the
            # init calls go out (a rendezvous, not a collective of any group the trainer uses).
            try:
                store = torch.distributed.TCPStore(host, port, world, True, timeout, multi_tenant=True,
                                                   master_listen_fd=listen.fileno())
            except RuntimeError as exc:  # older torch: the libuv store cannot take a listening socket
                if "listen fd" not in str(exc):
                    raise
                listen.close()  # the store binds the port itself (it was free a moment ago)
                store = torch.distributed.TCPStore(host, port, world, True, timeout, multi_tenant=True)
            return weight_wire.init_custom_process_group(backend, "", world, 0, name, timeout=timeout, store=store)

        creating = asyncio.ensure_future(weight_wire.in_daemon_thread(create))
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        calls = {u: asyncio.ensure_future(self._update(u, *self._init_request(host, port, off, world, name, backend),
                                                       "the weight-update group")) for u, off in zip(urls, offsets)}
        try:
            skipped = await self._collect(calls, creating, "the weight-update group", "init_weights_update_group")
        except BaseException:
            # Rank 0's side may still wait for the engines (until its timeout): its socket closes after.
            creating.add_done_callback(lambda done: self._abandon(done, listen))
            raise
        self._broken = False
        if skipped:  # an engine left while the group formed: form it again with the others
            creating.add_done_callback(lambda done: self._abandon(done, listen))
            raise _MembersChanged()
        self.group, self.group_name, self.members, self._socket = creating.result(), name, list(urls), listen
        self._changes = changes

    def _abandon(self, creating: "asyncio.Future[Any]", listen: socket.socket) -> None:
        """A group formed after its push gave up on it: keep it and its store's listening socket as
        they are, as a broken group is kept; a store that never started leaves the socket ours to close."""
        if not creating.cancelled() and creating.exception() is None:
            weight_wire.forget_process_group(creating.result())
            self._leaked.append((creating.result(), listen))
        else:
            listen.close()

    async def _disband(self) -> None:
        """Leave the current group: engines that still serve destroy their side (best effort)."""
        if self.group is None:
            return
        group, name, members = self.group, self.group_name, self.members
        self.group, self.group_name, self.members = None, None, []
        live = [u for u in members if u in self.client.worker_urls]
        path, body = self._destroy_request(name)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(self.rpc._request("POST", u + path, body, timeout=10) for u in live),
                                                  return_exceptions=True), 15)
        broken, self._broken = self._broken, False
        if not broken:
            weight_wire.destroy_process_group(group)
        if self._socket is not None:
            if broken:
                # The broken group is left as it is (destroying it can hang), and so is the listening
                # socket its store serves: closed under the running store, its event loop spins.
                weight_wire.forget_process_group(group)
                self._leaked.append((group, self._socket))
            else:
                self._socket.close()
            self._socket = None

    async def leave(self) -> None:
        """Disband the group (its engines destroy their side, its port closes); the next push forms
        a new one. The client stays open."""
        with contextlib.suppress(Exception):
            await self._disband()

    async def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):
                await self._disband()
        await super().close()

    async def push(self, named_tensors: Weights, version: Optional[int],
                   step: Optional[int] = None) -> Optional[KeptWeights]:
        named_tensors = self._streamed(named_tensors, _where(version, step))
        if self.device is None and isinstance(named_tensors, _Streamed):
            self.device = named_tensors.device()  # its first tensor, taken now (and held for its bucket)
        elif self.device is None and named_tensors:
            self.device = next(iter(named_tensors.values())).device
        # A replica that leaves mid-push breaks the group: form it again with the others and push
        # again from the first bucket (at most once per engine). A stream cannot be taken again:
        # for one, the bucket being broadcast is sent again instead (_send_flattened, _regroup);
        # this loop only repeats a stream's push whose group changed before its first bucket.
        for _ in range(len(self.client.worker_urls) + 1):
            try:
                return await super().push(named_tensors, version, step)
            except _MembersChanged:
                self._broken = True
        raise WeightSyncError(f"The weight sync of step {step} gave up: the serving engines kept changing.")

    async def _stage(self, named_tensors: Any, version: int) -> Any:
        return self._plan(named_tensors)

    async def _send(self, staged: Any, version: int, where: str) -> None:
        if self.flatten or isinstance(staged, _Streamed):
            await self._send_flattened(staged, version, where)
            return
        kept: list[Bucket] = []
        device = self.device or torch.device("cpu")
        for i, bucket in enumerate(staged):
            if self.keep:  # a copy for a replica that restarts (the tensors go on changing)
                kept.append(self._fill(bucket, torch.device("cpu")))
            if self.group is None:  # no engine serves: nothing to broadcast to
                continue
            body = {"names": [n for n, _ in bucket], "dtypes": [weight_wire.dtype_name(t.dtype) for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                    "flush_cache": self.flush_in_update, "abort_all_requests": False, "weight_version": _label(version)}
            calls = {u: asyncio.ensure_future(self._update(u, "/update_weights_from_distributed", body, where))
                     for u in self.members}
            # One broadcast per tensor, in order, straight from the trainer's tensors (slime's way):
            # no staging copy. Issued here, on the caller's thread; gloo/NCCL progress them meanwhile.
            sent = [t.detach().to(device).contiguous() for _, t in bucket]
            works = _Works([torch.distributed.broadcast(t, src=0, group=self.group, async_op=True) for t in sent])
            if await self._collect(calls, works, where, f"bucket {i + 1} of {len(staged)}"):
                raise _MembersChanged()
            del sent
        self._kept = kept

    async def _send_flattened(self, staged: Any, version: int, where: str) -> None:
        kept: list[Bucket] = []
        streamed = isinstance(staged, _Streamed)
        started = list(self.members)  # the engines this push began with
        async with self._filler(staged, self.device or torch.device("cpu")) as fills:
            for i in range(len(staged)):
                filled = await fills.get(i)
                # No engine serves (group None): nothing to broadcast to, the bucket is only kept.
                while self.group is not None:
                    path, body = self._bucket_request(filled, version)
                    calls = {u: asyncio.ensure_future(self._update(u, path, body, where)) for u in self.members}
                    # The broadcast is issued here, on the caller's thread; gloo/NCCL progress it meanwhile.
                    work = torch.distributed.broadcast(filled.flat, src=0, group=self.group, async_op=True)
                    if not await self._collect(calls, work, where, f"bucket {i + 1} of {len(staged)}"):
                        break
                    if not streamed:
                        raise _MembersChanged()  # push() starts again from the first bucket
                    await self._regroup(started, where)  # then this bucket again, from the staging buffer
                if self.keep:
                    kept.append(self._kept_copy(filled))
        self._kept = kept

    # ------------------------------------------------------------------ the engines' calls (SGLang's)

    def _init_request(self, host: str, port: int, rank_offset: int, world_size: int, name: str,
                      backend: str) -> tuple[str, dict[str, Any]]:
        """The call that has one engine join the group at ``rank_offset``: path and body."""
        return "/init_weights_update_group", {"master_address": host, "master_port": port, "rank_offset": rank_offset,
                                              "world_size": world_size, "group_name": name, "backend": backend}

    def _bucket_request(self, filled: Bucket, version: Optional[int]) -> tuple[str, dict[str, Any]]:
        """The call that has every engine receive one flattened bucket's broadcast: path and body."""
        meta = filled.metadata
        return "/update_weights_from_distributed", {
            "names": [m.name for m in meta], "dtypes": [weight_wire.dtype_name(m.dtype) for m in meta],
            "shapes": [list(m.shape) for m in meta], "group_name": self.group_name,
            "flush_cache": self.flush_in_update, "abort_all_requests": False,
            "weight_version": _label(version), "load_format": "flattened_bucket"}

    def _destroy_request(self, name: str) -> tuple[str, dict[str, Any]]:
        """The call that has an engine leave the group: path and body."""
        return "/destroy_weights_update_group", {"group_name": name}

    async def _regroup(self, started: Sequence[str], where: str) -> None:
        """Form the group again with the engines still serving, in the middle of a stream's push (an
        engine left during a bucket's broadcast; a stream cannot be taken again from its start).

        Sound because an engine of a flattened push loads a bucket only once it has received all of
        it: those still serving hold every earlier bucket of this push and, at most, this one
        (sent again, the same bytes), and they stay paused inside the update bracket meanwhile.
        Engines cannot join mid-push: a restarted replica joins (``RolloutPool.restart_replica``:
        kept weights, checksums, then ``workers.add``) under the pool's ``sync_lock``, which
        ``RolloutRuntime.sync_weights`` holds for the whole push; only leaving (the supervisor's
        ``_lose``) happens meanwhile. A joiner would lack this push's earlier buckets, so one is
        refused here rather than given half an update.

        Raises:
            WeightSyncError: an engine began serving during the push, or the serving set kept changing.
        """
        for _ in range(len(started) + 1):
            joined = [u for u in self.client.worker_urls if u not in started]
            if joined:
                raise WeightSyncError(f"The weight sync of {where} cannot go on: {', '.join(joined)} began serving "
                                      "during the push (a replica joins under the pool's sync lock, between pushes).")
            try:
                await self.connect()
                return
            except _MembersChanged:
                self._broken = True
        raise WeightSyncError(f"The weight sync of {where} gave up: the serving engines kept changing.")

    async def _collect(self, calls: dict[str, asyncio.Future], work: Any, where: str, what: str) -> list[str]:
        """Wait for every engine's answer and for rank 0's side (a ``Work`` or an executor future).

        Returns the URLs that left the serving set meanwhile (then the collective cannot complete
        and the group is formed again). A failed answer, or rank 0's side failing, fails the push at
        once, naming the engines that did not complete it; either way the group is marked broken.
        """
        deadline = time.monotonic() + self.timeout_s
        pending = dict(calls)
        try:
            while True:
                skipped = [u for u, c in list(pending.items()) if c.done() and c.result() is SKIPPED]
                if skipped:
                    self._broken = True
                    for call in pending.values():
                        call.cancel()
                    return skipped
                pending = {u: c for u, c in pending.items() if not c.done()}
                local_done = work.done() if isinstance(work, asyncio.Future) else work.is_completed()
                if local_done:  # raises if rank 0's side failed
                    work.result() if isinstance(work, asyncio.Future) else work.wait()
                    if not pending:
                        return []
                if time.monotonic() > deadline:
                    waiting = ", ".join(pending) or "rank 0's side (this process)"
                    raise WeightSyncError(f"The weight sync of {where} did not finish {what} within {self.timeout_s:g} s "
                                          f"(`{self.timeout_key}`); waiting for {waiting}.")
                await asyncio.sleep(0.002)
        except BaseException as exc:
            self._broken = True
            if isinstance(exc, (WeightSyncError, asyncio.CancelledError)):
                for call in calls.values():
                    call.cancel()
                raise
            # Rank 0's side failed (a peer went away): the engines' own answers say which. Those
            # still waiting are stuck in the broken collective; the gone ones failed or left.
            await asyncio.wait(list(calls.values()), timeout=3)
            gone = [u for u, c in calls.items() if c.done() and not c.cancelled()
                    and (c.exception() is not None or c.result() is SKIPPED)]
            for call in calls.values():
                call.cancel()
            if gone and self.client.supervised and await self._left(gone):
                return gone  # the supervisor took them out: form the group again without them
            lost = gone or [u for u, c in calls.items() if not c.done()]
            raise WeightSyncError(f"The weight sync of {where} failed at {what} on {', '.join(lost) or 'an engine'}: "
                                  f"{exc}") from exc

    async def _left(self, urls: Sequence[str], wait_s: float = 3.0) -> bool:
        """True once every one of ``urls`` has left the serving set (the supervisor's poll), within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while any(self.client.workers.is_live(u) for u in urls):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True


class _Works:
    """Several broadcasts awaited as one ``Work``: completed when all are, or as soon as one has
    failed (those after it may never complete); ``wait`` then raises that one's error."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def is_completed(self) -> bool:
        done = True
        for w in self.works:
            if not w.is_completed():
                done = False
            elif not w.is_success():
                return True
        return done

    def wait(self) -> None:
        for w in self.works:
            if w.is_completed() and not w.is_success():
                w.wait()  # raises its error
        for w in self.works:
            w.wait()


class _MembersChanged(Exception):
    """A member of the weight-update group left the serving set during a push."""


def _master_address(urls: Sequence[str]) -> str:
    """127.0.0.1 when every engine is on this host; else this host's address towards the first."""
    hosts = [urlparse(u).hostname or "127.0.0.1" for u in urls]

    def loopback(host: str) -> bool:
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    if all(loopback(h) for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((hosts[0], urlparse(urls[0]).port or 80))
        return probe.getsockname()[0]


DISTRIBUTED = WeightPath(name="distributed", make=DistributedWeightSync, client_method="update_weights_from_distributed")
"""``rollout.weight_sync: distributed``: a torch.distributed group the engines join (SGLang's
``/init_weights_update_group`` protocol), for engines on other hosts or GPUs."""

"""SGLang's weight-update wire formats, shared by the sender (the trainer) and the receiver (the
embedded engine). Each piece follows SGLang 0.5.23's own code, named where it is used:

- **Flattened buckets** (``srt/weight_sync/tensor_bucket.py``, ``FlattenedTensorBucket``): the
  tensors of a bucket viewed as bytes and concatenated in order into one ``uint8`` tensor, with a
  ``FlattenedTensorMetadata`` (name, shape, dtype, start/end byte offsets, byte count) per tensor.
  A receiver refuses a tensor whose byte offset is not a multiple of its element size, as
  ``FlattenedTensorBucket.empty`` does; :func:`plan_buckets` never produces one.
- **Serialised tensors** (``srt/utils/common.py``, ``MultiprocessingSerializer.serialize(obj,
  output_str=True)``): ``ForkingPickler`` then base64, so tensors travel as handles, not bytes.
  CPU storages go as shared-memory files (torch's ``file_system`` sharing strategy, whatever the
  process-wide one): the default ``file_descriptor`` strategy hands file descriptors over a socket
  that only processes sharing the sender's multiprocessing authkey may open, which an engine server
  does not. CUDA tensors go as CUDA IPC handles naming their device by UUID, as SGLang's
  ``monkey_patch_torch_reductions`` sends them. The bucket metadata is pickled under SGLang's class
  name, so SGLang's unpickler accepts it.
- **Restricted unpickling** (:func:`deserialize`): only the globals this format needs are admitted
  (torch's rebuild functions, storage and tensor classes, dtypes, ``torch.Size``, the bucket
  metadata, SGLang's ``LocalSerializedTensor``); anything else is refused before it is called.
- **The weight-update process group** (:func:`init_custom_process_group`): a ``PrefixStore`` named
  after the group over the ``tcp://`` rendezvous store, then ``_new_process_group_helper``, as
  SGLang's ``init_custom_process_group`` does on the engine side. ``init_process_group`` would use
  other store keys, and both sides would wait until their timeout.

No HTTP and no model code here.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import copyreg
import datetime
import io
import os
import pickle
import re
import threading
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch.multiprocessing import reductions

NamedTensors = Sequence[tuple[str, torch.Tensor]]

# Where SGLang defines the classes this format pickles (``SafeUnpickler.ALLOWED_GLOBALS``).
SGLANG_METADATA_CLASS = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
SGLANG_LOCAL_TENSOR_CLASSES = (
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
)
SGLANG_CUDA_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")


class UnsafePayload(ValueError):
    """A serialised payload that is malformed or asks for a global this format does not need."""


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a flattened bucket (SGLang's ``FlattenedTensorMetadata``, same fields)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes, as in SGLang (the numel of the tensor's uint8 view)


@dataclass
class LocalSerializedTensor:
    """SGLang's ``LocalSerializedTensor``: one serialised tensor per engine TP rank."""

    values: list[Any]

    def get(self, rank: int) -> Any:
        return deserialize(self.values[rank], "serialized_named_tensors")


# ------------------------------------------------------------------------------ dtypes and buckets


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype spelling in ``update_weights_from_distributed``: ``bfloat16``, no ``torch.``."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: Any) -> torch.dtype:
    """The torch dtype a name such as ``bfloat16`` (or ``torch.bfloat16``) spells.

    Raises:
        ValueError: not the name of a torch dtype.
    """
    value = getattr(torch, str(name).replace("torch.", ""), None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32').")
    return value


def layout(names: Sequence[str], dtypes: Sequence[torch.dtype],
           shapes: Sequence[Sequence[int]]) -> list[FlattenedTensorMetadata]:
    """The metadata of a flattened bucket holding these tensors in this order (SGLang's
    ``FlattenedTensorBucket.empty``, with its checks).

    Raises:
        ValueError: an empty bucket, a negative dimension, or a tensor at a byte offset that is not
            a multiple of its element size.
    """
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)}).")
    metadata, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        size = torch.Size(shape)
        if any(dim < 0 for dim in size):
            raise ValueError(f"Negative dimension in received tensor {name}: {tuple(size)}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        nbytes = size.numel() * dtype.itemsize
        metadata.append(FlattenedTensorMetadata(name, size, dtype, offset, offset + nbytes, nbytes))
        offset += nbytes
    if not metadata:
        raise ValueError("Cannot create empty tensor bucket")
    return metadata


def bucket_bytes(metadata: Sequence[FlattenedTensorMetadata]) -> int:
    return metadata[-1].end_idx if metadata else 0


def bucket_sha256(flat: torch.Tensor) -> str:
    """The sha256 of a flattened bucket's bytes (the ``fasync-gloo`` transfer checks each bucket by it)."""
    import hashlib

    return hashlib.sha256(flat.detach().cpu().contiguous().numpy()).hexdigest()


def flatten_into(named: NamedTensors, out: torch.Tensor) -> list[FlattenedTensorMetadata]:
    """Copy ``named`` into the ``uint8`` tensor ``out`` laid out as SGLang's FlattenedTensorBucket;
    returns the metadata. ``out`` may live anywhere (shared memory, a GPU); one copy per tensor."""
    metadata = layout([n for n, _ in named], [t.dtype for _, t in named], [t.shape for _, t in named])
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < bucket_bytes(metadata):
        raise ValueError(f"The bucket buffer must be a 1-D uint8 tensor of at least {bucket_bytes(metadata)} bytes.")
    for meta, (_, tensor) in zip(metadata, named):
        out[meta.start_idx : meta.end_idx].copy_(tensor.detach().reshape(-1).view(torch.uint8))
    return metadata


def unflatten(flat: torch.Tensor, metadata: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flattened bucket, as views of ``flat`` (SGLang's ``reconstruct_tensors``).

    Raises:
        ValueError: ``flat`` is not a 1-D uint8 tensor, or a tensor's bytes lie outside it or do not
            match its shape and dtype.
    """
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D uint8 tensor.")
    out = []
    for meta in metadata:
        name, dtype, shape = meta.name, meta.dtype, torch.Size(meta.shape)
        start, end = int(meta.start_idx), int(meta.end_idx)
        if not isinstance(dtype, torch.dtype) or not 0 <= start <= end <= flat.numel():
            raise ValueError(f"Tensor {name!r}: bytes [{start}, {end}) of a {flat.numel()}-byte bucket, dtype {dtype!r}.")
        if end - start != shape.numel() * dtype.itemsize or start % dtype.itemsize:
            raise ValueError(f"Tensor {name!r}: {end - start} bytes at offset {start} do not hold {dtype} {tuple(shape)}.")
        out.append((name, flat[start:end].view(dtype).reshape(shape)))
    return out


def plan_ranges(sizes: Sequence[tuple[int, int]], max_bytes: int) -> list[range]:
    """The bucketing rule, on sizes alone: tensors given as ``(bytes, element size)``, in order, split
    into consecutive runs of at most ``max_bytes`` each (a larger tensor goes alone), never placing a
    tensor at a byte offset that is not a multiple of its element size (SGLang's receiver refuses
    that). :func:`plan_buckets` applies it to tensors, a weight sync to a ``TensorStream``'s specs."""
    ranges: list[range] = []
    start = used = 0
    for i, (nbytes, itemsize) in enumerate(sizes):
        if i > start and (used + nbytes > max_bytes or used % itemsize):
            ranges.append(range(start, i))
            start, used = i, 0
        used += nbytes
    if len(sizes) > start:
        ranges.append(range(start, len(sizes)))
    return ranges


def plan_buckets(named: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Split ``named`` (in order) into buckets by :func:`plan_ranges`' rule."""
    items = list(named.items())
    sizes = [(t.numel() * t.element_size(), t.element_size()) for _, t in items]
    return [items[r.start : r.stop] for r in plan_ranges(sizes, max_bytes)]


def new_shared_bytes(nbytes: int) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``nbytes`` allocated in shared memory as a named file (torch's
    ``file_system`` strategy), so an unrelated process can map it; no copy on serialisation.

    Raises:
        MemoryError: ``/dev/shm`` has less room than that (writing past it would kill the process
            with SIGBUS instead of failing).
    """
    try:
        stat = os.statvfs("/dev/shm")
        free = stat.f_bavail * stat.f_frsize
    except OSError:
        free = None
    if free is not None and nbytes > free:
        raise MemoryError(
            f"{nbytes / 2**20:.0f} MiB of shared memory are needed and /dev/shm has {free / 2**20:.0f} MiB free; "
            "lower `rollout.weight_sync_bucket_mb`, give the container more shared memory (docker --shm-size) "
            "or use `rollout.weight_sync: disk`."
        )
    storage = torch.UntypedStorage._new_using_filename_cpu(max(int(nbytes), 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (int(nbytes),), (1,))


# ------------------------------------------------------------------------------ serialisation


def _reduce_storage_file_system(storage: torch.UntypedStorage) -> tuple:
    """torch's ``reduce_storage`` as under the ``file_system`` strategy (see the module docstring):
    the storage moves to (or already is) a named shared-memory file, referenced once more for the
    receiver, which drops that reference when it maps the file."""
    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)
    if storage.size() == 0:
        return (reductions.rebuild_storage_empty, (type(storage),))
    metadata = storage._share_filename_cpu_()
    storage._shared_incref()
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return (reductions.rebuild_storage_filename, (type(storage),) + metadata)


def _reduce_tensor_with_device_uuid(tensor: torch.Tensor) -> tuple:
    """torch's ``reduce_tensor``; a CUDA tensor names its device by UUID, as SGLang's patched
    reduction does, so a receiver with other visible devices finds the right one."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
    return rebuild, args


class _Pickler(pickle._Pickler):
    """``ForkingPickler``'s reductions with the two changes above; the bucket metadata is
    written under SGLang's class name (the pure-Python pickler,
    because the C one insists that a class be importable under the name it is written as; the
    payload holds handles and metadata only, so it stays small)."""

    _ALIASES = {FlattenedTensorMetadata: SGLANG_METADATA_CLASS}

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=4)
        table = copyreg.dispatch_table.copy()
        table.update(ForkingPickler._extra_reducers)
        table[torch.UntypedStorage] = _reduce_storage_file_system
        for cls in list(table):
            if table[cls] is reductions.reduce_tensor:
                table[cls] = _reduce_tensor_with_device_uuid
        self.dispatch_table = table

    def save_global(self, obj: Any, name: Optional[str] = None) -> None:
        alias = self._ALIASES.get(obj)
        if alias is None:
            return super().save_global(obj, name)
        self.save(alias[0])
        self.save(alias[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def serialize(obj: Any) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)``: the pickle, base64-encoded.

    The receiver maps the shared memory (or CUDA memory) the tensors live in: keep them alive and
    unchanged until it has answered.
    """
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_bucket(flat: torch.Tensor, metadata: Sequence[FlattenedTensorMetadata]) -> str:
    """One ``load_format="flattened_bucket"`` payload: ``{"flattened_tensor", "metadata"}``."""
    return serialize({"flattened_tensor": flat, "metadata": list(metadata)})


# ------------------------------------------------------------------------------ restricted unpickling

_HANDLE = re.compile(rb"/torch_[0-9]+_[0-9]+_[0-9]+")


def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
    """torch's ``rebuild_storage_filename`` for a handle that names a torch shared-memory file."""
    if not (isinstance(manager, bytes) and manager.startswith(b"/") and isinstance(handle, bytes)
            and _HANDLE.fullmatch(handle) and isinstance(size, int) and size >= 0):
        raise UnsafePayload(f"Not a torch shared-memory storage handle: {handle!r:.80}.")
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


def _device_index(device: Union[int, str]) -> int:
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise UnsafePayload(f"No visible CUDA device has the UUID {device!r} the tensor names.")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor``, with the device given by index or by UUID (SGLang's)."""
    return reductions.rebuild_cuda_tensor(*args[:6], _device_index(args[6]), *args[7:])


def _admitted() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"): reductions.rebuild_typed_storage_child,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
        SGLANG_CUDA_REBUILD: _rebuild_cuda_tensor,
        ("torch", "Size"): torch.Size,
        ("torch", "Tensor"): torch.Tensor,
        ("torch._tensor", "Tensor"): torch.Tensor,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        SGLANG_METADATA_CLASS: FlattenedTensorMetadata,
        (__name__, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    }
    for path in SGLANG_LOCAL_TENSOR_CLASSES:
        table[path] = LocalSerializedTensor
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            table[("torch", name)] = value
        elif isinstance(value, type) and name.endswith("Storage") and issubclass(value, torch.storage.TypedStorage):
            table[("torch", name)] = value  # torch.FloatStorage and its kin: the typed storage classes
    return table


class _RestrictedUnpickler(pickle.Unpickler):
    ADMITTED = _admitted()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.ADMITTED[(module, name)]
        except KeyError:
            pass
        if name == "rebuild_storage_fd":
            raise UnsafePayload(
                "a CPU tensor shared by file descriptor (torch's default sharing strategy) cannot be opened by another "
                "process; serialise with torch.multiprocessing.set_sharing_strategy('file_system')"
            )
        raise UnsafePayload(f"the payload asks for {module}.{name}, which a tensor payload does not need")


def decode(payload: Any, field: str) -> bytes:
    """The pickle bytes of one payload: a base64 string (what HTTP carries) or the bytes themselves.

    Raises:
        UnsafePayload: not base64 (or bytes); the message names ``field``.
    """
    if isinstance(payload, str):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UnsafePayload(f"`{field}` is not valid base64: {exc}.") from None
    if not isinstance(payload, (bytes, bytearray)):
        raise UnsafePayload(f"`{field}` must hold base64 strings, got {type(payload).__name__}.")
    return bytes(payload)


def deserialize(payload: Any, field: str) -> Any:
    """``MultiprocessingSerializer.deserialize`` through the restricted unpickler.

    Args:
        payload: A base64 string (what HTTP carries) or the raw pickle bytes.
        field: The request field it came in, for the error message.

    Raises:
        UnsafePayload: not base64, not a pickle, or a pickle asking for a global outside the
            admitted set (nothing of it is called); the message names ``field``.
    """
    data = decode(payload, field)
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePayload as exc:
        raise UnsafePayload(f"`{field}` was refused: {exc}.") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is the payload's fault
        raise UnsafePayload(f"`{field}` could not be deserialised: {type(exc).__name__}: {exc}.") from None


# ------------------------------------------------------------------------------ the process group


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str,
    timeout: Optional[datetime.timedelta] = None, store: Any = None,
) -> Any:
    """Create (rank 0) or join the weight-update group as SGLang's ``init_custom_process_group``
    does (``srt/utils/common.py``): the ``tcp://`` rendezvous store (rank 0 serves it), a
    ``PrefixStore(group_name)`` over it, then ``_new_process_group_helper``. Needs no default
    process group; with one (a DDP trainer) the new group is separate from it.

    Args:
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
        init_method: ``tcp://host:port`` of rank 0's store (unused with ``store``).
        world_size: 1 + the TP ranks of every engine.
        rank: This process's rank (the trainer is 0; an engine TP rank joins at its rank offset).
        group_name: The group's name (the store prefix; unique within the process).
        timeout: How long collectives and the rendezvous wait; SGLang's default (30 min) if None.
        store: The rendezvous store itself (rank 0 may serve it on a socket of its choosing): the
            ``TCPStore`` the ``tcp://`` rendezvous would make, without the prefix.
    """
    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, default_pg_timeout, rendezvous,
    )

    timeout = timeout or default_pg_timeout
    if store is None:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


async def in_daemon_thread(fn: Any, *args: Any) -> Any:
    """Await a blocking rendezvous, group creation or receive run on a daemon thread of its own: one
    whose peer went away waits until the group's timeout, and must neither hold an executor thread
    nor keep the process from exiting meanwhile. (Creating a group and receiving into it are the
    only things done there; the trainer's broadcasts are issued on its main thread.)"""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            done.set_result(value) if ok else done.set_exception(value)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting handler
            loop.call_soon_threadsafe(settle, False, exc)
        else:
            loop.call_soon_threadsafe(settle, True, result)

    threading.Thread(target=run, name="fasync-weight-group", daemon=True).start()
    return await done


def destroy_process_group(pg: Any) -> None:
    """Destroy a group :func:`init_custom_process_group` made; a group already gone is ignored."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except (ValueError, RuntimeError):
        pass


def forget_process_group(pg: Any) -> None:
    """Take a group :func:`init_custom_process_group` made out of torch.distributed's registry of
    groups, without shutting it down: a broken group (a peer died in a collective) is kept as it
    is, since shutting it down can hang or abort the process. Out of the registry, no one else's
    ``destroy_process_group()`` (which shuts down every registered group, as megatron-core's
    teardown or a test's does) reaches it."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    name = world.pg_names.get(pg)
    for registry in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag,
                     world.pg_coalesce_state):
        registry.pop(pg, None)
    for groups in world.tags_to_pg.values():
        while pg in groups:
            groups.remove(pg)
    unregister = getattr(c10d, "_unregister_process_group", None)
    if name is not None and unregister is not None:
        with contextlib.suppress(Exception):
            unregister(name)

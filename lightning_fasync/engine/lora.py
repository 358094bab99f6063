"""The embedded engine's LoRA adapters: SGLang 0.5.23's ``/load_lora_adapter`` and
``/unload_lora_adapter`` (``srt/entrypoints/http_server.py``; request fields from
``srt/managers/io_struct.py``: ``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``; answers
``LoRAUpdateOutput``: ``success``, ``error_message``, ``loaded_adapters`` name -> path, 200 or 400).

How an adapter is applied: **merged into the served weights on load**. The engine decodes with
fused matrices rebuilt from the Hugging Face weights after every update (``ModelRunner.refresh_weights``),
so a loaded adapter is written into those weights (base + scale·B·A, :func:`~lightning_fasync.lora.merge_weight`)
and serves every request at full speed; unloading writes the base back. The base of each adapted
weight is kept (a copy of those weights only) from the load until the unload, and a full weight
update meanwhile becomes the new base with the adapter merged onto it again (:func:`on_weight_update`),
as SGLang's adapters stay loaded over weight updates. So one adapter is loaded at a time
(SGLang's ``--max-loras-per-batch 1``), and it applies to every request: a ``/generate`` that names
it (``lora_path``) is served, one that names another adapter is refused with 400, and one that names
none is served with it too (SGLang would serve such a request with the base model; here there is no
base to serve meanwhile). A trainer's adapter push (``rollout.weight_sync: adapter``) unloads the
previous adapter and loads the new one under the same name.

Where an adapter may be loaded from: the path is untrusted input, and only a directory inside the
engine's LoRA directory is accepted (``$FASYNC_ENGINE_LORA_DIR``; by default a private directory the
engine creates at start, mode 0700, removed at exit), after resolving links and ``..``
(``os.path.realpath``); ``/server_info`` reports it as ``lora_dir``, where a trainer on this host
writes its adapters. The adapter is read from ``adapter_config.json`` and ``adapter_model.safetensors``
only (no pickle), each a regular file of that directory within a size cap, opened without following
links (:func:`~lightning_fasync.lora.read_adapter_dir`): a link inside the directory is refused, as
it could point anywhere.

Loads and unloads run one at a time (:attr:`LoRAState.lock`, held from the check of what is loaded
to the change of the weights), so two concurrent loads never both merge; neither is idempotent, and
clients send them once (``SGLangClient._lora_call``).

An app built with ``enable_lora=False`` refuses every load, as SGLang does without ``--enable-lora``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from aiohttp import web

from lightning_fasync.engine import protocol
from lightning_fasync.engine.http_common import ENGINE_KEY, STATE_KEY, blocking, json_body
from lightning_fasync.engine.protocol import BadRequest

LORA_KEY = "lora"
_COMMON = {"rid", "http_worker_ipc"}  # SGLang's BaseReq fields
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # SGLang's message
LOCK_TIMEOUT_S = 600.0
"""How long a load or unload waits for the one running before it (:attr:`LoRAState.lock`) before it is refused."""


@dataclass
class Loaded:
    """The adapter merged into the served weights."""

    name: str
    path: str
    deltas: dict[str, Any]  # weight name -> LoRADelta
    base: dict[str, Any] = field(default_factory=dict)  # weight name -> the base weight (a copy)


@dataclass
class LoRAState:
    """The engine's adapters: whether loading is on, the one directory adapters load from, and the
    adapter loaded now (None: the base weights are served)."""

    enabled: bool
    lora_dir: Optional[str]
    owned_dir: bool = False  # created by the engine: removed at exit
    loaded: Optional[Loaded] = None
    # Held by a load or unload from its check of ``loaded`` to its change of the weights, so two
    # calls never both see no adapter loaded and merge twice (or unload twice).
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def create(cls, enabled: bool, lora_dir: Optional[str]) -> "LoRAState":
        """The state of a server whose adapters load from ``lora_dir`` (None: a private directory made
        now) or, without ``enabled``, with adapters off."""
        if not enabled:
            return cls(False, None)
        if lora_dir is None:
            return cls(True, os.path.realpath(tempfile.mkdtemp(prefix="lfa-lora-")), owned_dir=True)
        if not os.path.isdir(lora_dir):
            raise ValueError(f"The LoRA directory {lora_dir!r} (FASYNC_ENGINE_LORA_DIR) is not a directory.")
        return cls(True, os.path.realpath(lora_dir))

    def close(self) -> None:
        if self.owned_dir and self.lora_dir:
            shutil.rmtree(self.lora_dir, ignore_errors=True)


def state_of(app: web.Application) -> LoRAState:
    return app[STATE_KEY][LORA_KEY]


def _answer(state: LoRAState, success: bool, message: str = "") -> web.Response:
    loaded = {state.loaded.name: state.loaded.path} if state.loaded is not None else {}
    return web.json_response({"success": success, "error_message": message, "loaded_adapters": loaded},
                             status=200 if success else 400)


def allowed_path(state: LoRAState, path: str) -> str:
    """``path`` resolved, if it is a directory inside the LoRA directory; the rule of the module docstring.

    Raises:
        ValueError: anything else (the message says where adapters load from).
    """
    assert state.lora_dir is not None
    resolved = os.path.realpath(path)
    if os.path.commonpath([resolved, state.lora_dir]) != state.lora_dir or resolved == state.lora_dir:
        raise ValueError(f"lora_path {path!r} is outside the engine's LoRA directory {state.lora_dir!r} "
                         "(FASYNC_ENGINE_LORA_DIR); adapters load only from directories inside it.")
    if not os.path.isdir(resolved):
        raise ValueError(f"lora_path {path!r} is not a directory holding adapter_config.json and "
                         "adapter_model.safetensors.")
    return resolved


def _read(engine: Any, path: str) -> dict[str, Any]:
    """The adapter's deltas, checked against the served model's weights (off the event loop)."""
    from lightning_fasync.lora import adapter_deltas, read_adapter_dir

    config, tensors = read_adapter_dir(path)
    deltas = adapter_deltas(config, tensors)
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    for name, delta in deltas.items():
        param = params.get(name)
        if param is None:
            raise ValueError(f"the adapter targets {name!r}, which is not a weight of the served model.")
        out, inp = (param.shape[1], param.shape[0]) if delta.fan_in_fan_out else tuple(param.shape)
        if (delta.b.shape[0], delta.a.shape[1]) != (out, inp):
            raise ValueError(f"the adapter of {name!r} updates a {delta.b.shape[0]}x{delta.a.shape[1]} weight; the "
                             f"served one is {tuple(param.shape)}.")
    return deltas


def _merge(loaded: Loaded, names: Any = None) -> dict[str, Any]:
    from lightning_fasync.lora import merge_weight

    return {n: merge_weight(loaded.base[n], loaded.deltas[n]) for n in (names if names is not None else loaded.deltas)}


async def _locked(state: LoRAState, name: str, action: str, handler: Callable[[], Any]) -> web.Response:
    """``handler()`` with ``state.lock`` held, so a load or unload checks what is loaded and changes
    the weights as one step; a call that waits past :data:`LOCK_TIMEOUT_S` is refused. The handler
    runs shielded: a cancelled request never leaves the weights changed and ``state.loaded`` not."""
    try:
        await asyncio.wait_for(state.lock.acquire(), LOCK_TIMEOUT_S)
    except asyncio.TimeoutError:
        return _answer(state, False, f"Failed to {action} LoRA adapter {name}: another adapter load or unload held "
                                     f"the engine for more than {LOCK_TIMEOUT_S:g} s.")
    task = asyncio.ensure_future(handler())
    task.add_done_callback(lambda _: state.lock.release())
    return await asyncio.shield(task)


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"lora_name", "lora_path", "pinned", "lora_id", *_COMMON}, "load_lora_adapter")
    name = protocol.req(body, "lora_name", str)
    path = protocol.req(body, "lora_path", str)
    protocol.opt(body, "pinned", bool, False)  # one adapter at a time: it is never evicted
    protocol.opt(body, "lora_id", str, None)
    if not name:
        raise BadRequest("`lora_name` must not be empty.")
    state = state_of(request.app)
    if not state.enabled:
        return _answer(state, False, NOT_ENABLED)
    engine = request.app[ENGINE_KEY]

    async def load() -> web.Response:
        if state.loaded is not None:
            message = (f"Failed to load LoRA adapter {name} because it is already loaded" if state.loaded.name == name
                       else f"Failed to load LoRA adapter {name}: the embedded engine merges one adapter into its "
                            f"weights and {state.loaded.name!r} is loaded; unload it first.")
            return _answer(state, False, message)
        try:
            resolved = allowed_path(state, path)
            deltas = await blocking(_read, engine, resolved)
        except ValueError as exc:
            return _answer(state, False, f"Failed to load LoRA adapter {name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a damaged file: the caller is told, the server goes on
            return _answer(state, False, f"Failed to load LoRA adapter {name}: {type(exc).__name__}: {exc}")
        async with request.app[STATE_KEY]["weights_lock"]:
            params = dict(engine.model.named_parameters(remove_duplicate=False))
            loaded = Loaded(name, path, deltas, {n: params[n].detach().clone() for n in deltas})
            try:
                merged = await blocking(_merge, loaded)
                await blocking(engine.update_weights, merged, None)
            except ValueError as exc:
                return _answer(state, False, f"Failed to load LoRA adapter {name}: {exc}")
            state.loaded = loaded
        return _answer(state, True)

    return await _locked(state, name, "load", load)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"lora_name", "lora_id", *_COMMON}, "unload_lora_adapter")
    name = protocol.req(body, "lora_name", str)
    protocol.opt(body, "lora_id", str, None)
    state = state_of(request.app)
    if not state.enabled:
        return _answer(state, False, NOT_ENABLED)
    engine = request.app[ENGINE_KEY]

    async def unload() -> web.Response:
        if state.loaded is None or state.loaded.name != name:
            loaded = [state.loaded.name] if state.loaded is not None else []
            return _answer(state, False, f"LoRA adapter {name} is not loaded; loaded adapters: {loaded}.")
        async with request.app[STATE_KEY]["weights_lock"]:
            try:
                await blocking(engine.update_weights, dict(state.loaded.base), None)
            except ValueError as exc:
                return _answer(state, False, f"Failed to unload LoRA adapter {name}: {exc}")
            state.loaded = None
        return _answer(state, True)

    return await _locked(state, name, "unload", unload)


def on_weight_update(app: web.Application, tensors: dict[str, Any]) -> Callable[[], None]:
    """Before a full weight update is loaded (``http_common.apply_update``; the weights lock is held):
    with an adapter loaded, what is loaded in place of each updated weight it adapts is that weight
    with the adapter merged, so the adapter stays applied. Returns the commit, to call once the
    engine has loaded ``tensors``: the updated weights then become the adapter's new base. An
    update the engine refuses is not committed, so the base stays the one served, and unloading
    still restores it. A weight whose shape is not the base's is left as it is, for the engine to
    refuse the update (no merge is attempted)."""
    state = app[STATE_KEY].get(LORA_KEY)
    loaded = state.loaded if state is not None else None
    if loaded is None:
        return lambda: None
    from lightning_fasync.lora import merge_weight

    new_base: dict[str, Any] = {}
    for name in [n for n in tensors if n in loaded.deltas]:
        like = loaded.base[name]
        if tuple(tensors[name].shape) != tuple(like.shape):
            continue
        new_base[name] = tensors[name].detach().to(like.device, like.dtype, copy=True)
    tensors.update({n: merge_weight(base, loaded.deltas[n]) for n, base in new_base.items()})

    def commit() -> None:
        if state.loaded is loaded:
            loaded.base.update(new_base)

    return commit


def generate_adapter(app: web.Application, body: dict[str, Any]) -> None:
    """Take a ``/generate`` body's ``lora_path`` / ``lora_id`` (SGLang's per-request adapter, one
    name or one per prompt, null for none): each name must be the loaded adapter's, else 400; null
    names none, and the request is served with the weights as they are (module docstring). They
    are removed from ``body``, which is then parsed as any other."""
    names = body.pop("lora_path", None)
    body.pop("lora_id", None)
    if names is None:
        return
    state = app[STATE_KEY].get(LORA_KEY)
    wanted = names if isinstance(names, list) else [names]
    if not all(isinstance(n, str) or n is None for n in wanted):
        raise BadRequest("`lora_path` must be a string or a list of strings and nulls.")
    loaded = state.loaded.name if state is not None and state.loaded is not None else None
    for n in wanted:
        if n is not None and n != loaded:
            if state is None or not state.enabled:
                raise BadRequest(f"LoRA adapter '{n}' was requested, but LoRA is not enabled. Please launch the "
                                 "server with --enable-lora flag and preload adapters using --lora-paths or "
                                 "/load_lora_adapter endpoint.")
            raise BadRequest(f"LoRA adapter '{n}' is not loaded; loaded adapters: {[loaded] if loaded else []}.")


def add_routes(app: web.Application, enabled: bool = True, lora_dir: Optional[str] = None) -> None:
    """Register the two endpoints and the engine's LoRA state (see :meth:`LoRAState.create`)."""
    state = LoRAState.create(enabled, lora_dir)
    app[STATE_KEY][LORA_KEY] = state
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)

    async def close(app: web.Application) -> None:
        state.close()

    app.on_cleanup.append(close)

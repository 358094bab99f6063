"""Test-only helpers for running megatron-core on CPU, in the test process.

megatron-core's forward is written for CUDA. With the local layer spec (no Transformer Engine, no
fused kernels, dropout 0, an explicit attention mask) only two calls need a GPU, and
:func:`cpu_forward_shim` patches exactly those while it is active:

1. ``torch.cuda.current_device`` returns ``"cpu"``: ``RotaryEmbedding.get_emb`` moves its
   ``inv_freq`` to the current CUDA device on the first forward, and
   ``GlobalMemoryBuffer.get_tensor`` (DotProductAttention's score buffer) allocates there.
   ``TopKRouter.gating`` moves the router weight there too.
2. ``CudaRNGStatesTracker.fork`` is a no-op context: DotProductAttention forks the CUDA RNG
   around its (here p = 0) attention dropout.
3. ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is defined as None: megatron-core
   0.16 imports it only with Transformer Engine, yet ``router_gating_linear`` reads it always (a
   NameError without TE, on GPU too); 0.17+ sets it to None itself, which selects the torch path.

Nothing else is patched; the model's arithmetic is megatron-core's own.

Training (megatron-core's ``DistributedDataParallel``, its optimizers, ``get_forward_backward_func``'s
schedules, pipeline p2p) is written for CUDA in more places; :func:`cpu_training_shim` adds, on top
of the above:

4. :class:`CudaAsCpu`, a ``TorchFunctionMode``: a ``device=`` argument naming CUDA becomes
   ``cpu`` (``torch.zeros(..., device="cuda")`` in the schedules' token counter, the optimizers'
   ``found_inf`` / ``_scale``, the grad buffers); ``Tensor.cuda()`` returns the tensor itself;
   ``Tensor.type()`` answers ``torch.cuda.FloatTensor`` for ``torch.FloatTensor`` (the optimizers
   check their parameters' types by these names).
5. ``torch.cuda.synchronize`` is a no-op (pipeline p2p waits with it after ``batch_isend_irecv``).
6. ``torch.cuda.Stream``, ``torch.cuda.current_stream`` and ``torch.cuda.stream`` are stand-ins
   whose waits do nothing (CPU work is ordered anyway), and the all-to-all token dispatcher's
   ``maybe_move_tensor_to_cpu`` gives a host tensor (or, asked, a numpy array) as it does for a CUDA
   one: the MoE dispatcher copies its split sizes to the host on a side stream.

Collectives, gradients, optimizer arithmetic and the schedules are megatron-core's own, over gloo.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode


@contextlib.contextmanager
def cpu_forward_shim():
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.core.transformer.moe import moe_utils

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(mc_random.CudaRNGStatesTracker, "fork",
                                              lambda self, *a, **k: contextlib.nullcontext()))
        if not hasattr(moe_utils, "te_general_gemm"):
            stack.enter_context(mock.patch.object(moe_utils, "te_general_gemm", None, create=True))
        yield


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    d = torch.device(device)
    return torch.device("cpu") if d.type == "cuda" else d


class CudaAsCpu(TorchFunctionMode):
    """CPU stands in for CUDA: see the module docstring, item 4."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to:
            args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


class _Stream:
    """Stands in for ``torch.cuda.Stream`` on CPU (item 6)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return _Event()


class _Event:
    """What :meth:`_Stream.record_event` returns: complete at once."""

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


_DEFAULT_STREAM = _Stream()


def _to_host(tensor, as_numpy=False, record_stream=False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors that are on the host already (item 6)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


@contextlib.contextmanager
def cpu_training_shim():
    """:func:`cpu_forward_shim` plus what megatron-core's training path needs on CPU (items 4-6)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_forward_shim())
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(torch.cuda, "Stream", _Stream))
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a, **k: _DEFAULT_STREAM))
        stack.enter_context(mock.patch.object(torch.cuda, "stream", lambda s=None: contextlib.nullcontext()))
        from megatron.core.transformer.moe import token_dispatcher

        stack.enter_context(mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", _to_host))
        stack.enter_context(CudaAsCpu())
        yield


def _spawned(rank, world, port, init, fn, args):
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    if init:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:  # as torchrun leaves it: Lightning's strategy creates the group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                          WORLD_SIZE=str(world), RANK=str(rank))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cpu_training_shim():
                fn(rank, *args)
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 240.0, init_process_group: bool = True):
    """Run ``fn(rank, *args)`` on ``world`` spawned processes over a gloo group on 127.0.0.1, under
    :func:`cpu_training_shim`; ``fn`` initialises megatron-core's parallel state itself (it is torn
    down after). With ``init_process_group=False`` the ranks get torchrun's environment instead
    (``LOCAL_RANK``, ``MASTER_PORT``...) and a Lightning strategy creates the group. ``fn`` must be
    importable (module level). A failing rank fails the call."""
    import torch.multiprocessing as mp

    from lightning_fasync.fleet.launch import free_port

    ctx = mp.start_processes(_spawned, args=(world, free_port(), init_process_group, fn, args), nprocs=world,
                             join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout:.0f} s")


@contextlib.contextmanager
def single_process_parallel_state(**sizes):
    """A 1-process gloo group on 127.0.0.1 and megatron-core's parallel state over it (as
    megatron's unit tests' ``Utils.initialize_model_parallel`` does, with gloo instead of NCCL);
    both torn down afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from lightning_fasync.fleet.launch import free_port

    assert not dist.is_initialized(), "a process group already exists in this test process"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(**sizes)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def require_megatron():
    """Import megatron-core, or skip (fail under ``LFA_REQUIRE_MEGATRON=1``, as scripts/test sets)."""
    import pytest

    try:
        import megatron.core  # noqa: F401
    except ImportError:
        if os.environ.get("LFA_REQUIRE_MEGATRON") == "1":
            raise RuntimeError("megatron-core is not installed; scripts/test installs tests/requirements-megatron.txt.")
        pytest.skip("megatron-core is not installed (the `megatron` extra)", allow_module_level=True)


# Tiny configs, one per family, each with what sets it apart: Llama with llama3 RoPE scaling,
# Qwen2's q/k/v biases, Qwen3 with head_dim != hidden / heads and tied embeddings (as Qwen3-0.6B),
# Qwen3-MoE with renormalised top-2 of 4 experts. GQA (4 heads, 2 groups) everywhere.
_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
TINY = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  max_position_embeddings=16384),
    "qwen2": dict(rope_theta=1000000.0),
    "qwen3": dict(head_dim=16, tie_word_embeddings=True),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      norm_topk_prob=True, router_aux_loss_coef=0.001),
}


def tiny_hf_config(family: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**_COMMON, **TINY[family]})


def tiny_hf_model(family: str, seed: int = 0):
    """A random fp32 HF model of the family; norms randomised too, so a swapped norm shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()

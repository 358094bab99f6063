"""Shard a Hugging Face policy for Lightning's ``ModelParallelStrategy``: tensor parallel (DTensor)
within a node, then FSDP2 ``fully_shard`` over the data-parallel group.

:func:`shard_policy` is what :meth:`RLPolicyModule.configure_model
<lightning_fasync.lightning.module.RLPolicyModule.configure_model>` calls with the strategy's
device mesh (dims ``("data_parallel", "tensor_parallel")``). It works on CPU with gloo, so the
sharded path is tested without GPUs.

Tensor parallel (``tensor_parallel_size > 1``) covers the Qwen2, Qwen3 and Llama families: in every
decoder layer q/k/v and gate/up are column-parallel, o/down row-parallel (Megatron's layout; one
all-reduce per attention block and per MLP in forward, one in backward); embeddings, norms and
``lm_head`` stay whole on every rank. Grouped-query attention with fewer kv heads than TP ranks is
handled as Megatron does it: k/v projections stay whole and replicated, and each rank computes only
the kv head its local query heads read (see :class:`_KVHeadsLinear`). The parameter names stay the
Hugging Face names throughout (``policy.state_dict()`` has the same keys before and after).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_fasync.config import ConfigError

__all__ = ["MIXED_PRECISION", "TP_MODEL_TYPES", "shard_policy", "tp_head_layout"]

MIXED_PRECISION: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}  # config.MIXED_PRECISION
"""``mixed_precision`` names: the dtype FSDP2 all-gathers the parameters in and computes with
(gradients are reduced, and the optimizer steps, in float32)."""

TP_MODEL_TYPES = ("llama", "qwen2", "qwen3")
"""Hugging Face ``config.model_type`` values with a tensor-parallel plan."""


def _sum_grad_over(mesh: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Identity in forward; in backward the gradient is summed over ``mesh`` (Megatron's "copy to
    tensor-parallel region"). A tensor every TP rank holds whole but uses only in part (its local
    heads) gets a partial gradient on each rank; the sum is the full one, the same on every rank.
    DTensor does the all-reduce: a Replicate input whose gradient is declared Partial."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class _KVHeadsLinear(nn.Linear):
    """``k_proj`` / ``v_proj`` when the TP size is a multiple of the kv heads: the weight (and bias)
    stay whole and replicated on every TP rank, and the rank computes only the rows of the kv head
    its query heads map to (``rank * kv_heads // tp``), as Megatron does for GQA.

    Each rank's gradient of those rows covers only its own query heads, so the input, the weight
    and the bias go through :func:`_sum_grad_over` before the row selection: the activation gradient
    and the weight gradient are then the full sums, identical on all TP ranks. (The sum is taken
    over the whole weight, not over the selected rows, since ranks select different rows.)
    """

    _tp_mesh: Any
    _rows: slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _sum_grad_over(self._tp_mesh, self.weight)[self._rows]
        bias = None if self.bias is None else _sum_grad_over(self._tp_mesh, self.bias)[self._rows]
        return F.linear(_sum_grad_over(self._tp_mesh, x), weight, bias)


class _GradSumWeight(nn.Module):
    """Mixin for a module whose ``weight`` is shared by heads split over TP ranks (Qwen3's per-head
    ``q_norm`` / ``k_norm``): forward runs the module's own code with the weight passed through
    :func:`_sum_grad_over`, so its gradient is the sum over the ranks' heads. The parameter stays
    registered under its name; only the forward sees the wrapped tensor."""

    _tp_mesh: Any

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        param = self._parameters["weight"]
        # The module's code reads self.weight; for this call it is the wrapped tensor (FSDP2 swaps
        # parameters in _parameters the same way).
        self._parameters["weight"] = _sum_grad_over(self._tp_mesh, param)  # type: ignore[assignment]
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._parameters["weight"] = param


def _swap_class(module: nn.Module, mixin: type, **attrs: Any) -> None:
    """Give ``module`` a subclass of its class with ``mixin``'s forward (FSDP2's technique): its
    parameters, names and state-dict keys stay as they are."""
    cls = module.__class__
    if issubclass(mixin, cls):  # the mixin already is a subclass (plain nn.Linear -> _KVHeadsLinear)
        module.__class__ = mixin
    elif not issubclass(cls, mixin):
        module.__class__ = type(f"{mixin.__name__.lstrip('_')}{cls.__name__}", (mixin, cls), {})
    for name, value in attrs.items():
        setattr(module, name, value)


def tp_head_layout(config: Any, tp: int) -> str:
    """How ``config``'s heads split over ``tp`` ranks: ``"sharded"`` (kv heads divisible by ``tp``)
    or ``"replicated_kv"`` (``tp`` a multiple of the kv heads: each rank uses one whole kv head).

    Raises:
        ConfigError: the model type has no plan, or the heads / MLP width do not split over ``tp``.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in TP_MODEL_TYPES:
        raise ConfigError(
            f"`tensor_parallel_size` is {tp}, but the policy's model type {model_type!r} has no tensor-parallel "
            f"plan (supported: {', '.join(TP_MODEL_TYPES)}); use tensor_parallel_size=1 (FSDP2 only)."
        )
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        raise ConfigError(
            f"`tensor_parallel_size` is {tp}, which does not divide the policy's {heads} attention heads; "
            "it must divide num_attention_heads."
        )
    if config.intermediate_size % tp:
        raise ConfigError(
            f"`tensor_parallel_size` is {tp}, which does not divide the policy's intermediate_size "
            f"{config.intermediate_size}; it must divide the MLP width."
        )
    if kv_heads % tp == 0:
        return "sharded"
    if tp % kv_heads == 0:
        return "replicated_kv"
    raise ConfigError(
        f"`tensor_parallel_size` is {tp} with {heads} attention heads and {kv_heads} key/value heads; "
        "it must divide num_key_value_heads or be a multiple of it."
    )


def _parallelize_layers(policy: nn.Module, tp_mesh: Any) -> None:
    """Apply the TP plan to every decoder layer of a Llama / Qwen2 / Qwen3 policy."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = policy.config
    tp = tp_mesh.size()
    layout = tp_head_layout(config, tp)
    rank = tp_mesh.get_local_rank()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    plan: dict[str, Any] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if layout == "sharded":
        plan["self_attn.k_proj"] = ColwiseParallel()
        plan["self_attn.v_proj"] = ColwiseParallel()
    for layer in policy.model.layers:
        attn = layer.self_attn
        parallelize_module(layer, tp_mesh, plan)
        if layout == "replicated_kv":
            kv_head = rank * kv_heads // tp
            rows = slice(kv_head * attn.head_dim, (kv_head + 1) * attn.head_dim)
            _swap_class(attn.k_proj, _KVHeadsLinear, _tp_mesh=tp_mesh, _rows=rows)
            _swap_class(attn.v_proj, _KVHeadsLinear, _tp_mesh=tp_mesh, _rows=rows)
            # The attention functions repeat each kv head num_key_value_groups times to meet the
            # query heads: locally that is heads // tp query heads on one kv head.
            attn.num_key_value_groups = heads // tp
        # (With sharded kv heads the local ratio heads/kv_heads is unchanged, and HF's reshapes
        # use -1 heads, so the attention code needs nothing else.)
        for name in ("q_norm", "k_norm"):  # Qwen3: one head_dim weight shared by all heads
            norm = getattr(attn, name, None)
            if isinstance(norm, nn.Module) and isinstance(norm._parameters.get("weight"), nn.Parameter):
                _swap_class(norm, _GradSumWeight, _tp_mesh=tp_mesh)


def _decoder_layers(policy: nn.Module) -> list[nn.Module]:
    """The repeated blocks to ``fully_shard`` one by one: the modules of the classes Hugging Face
    names in ``_no_split_modules`` (its own unit for sharding), else ``model.layers``."""
    names = set(getattr(policy, "_no_split_modules", None) or ())
    layers = [m for m in policy.modules() if type(m).__name__ in names] if names else []
    if not layers:
        layers = list(getattr(getattr(policy, "model", None), "layers", None) or [])
    return layers


def _enable_activation_checkpointing(policy: nn.Module) -> None:
    """Hugging Face's own per-layer checkpointing (non-reentrant torch.utils.checkpoint): unlike
    torch's ``checkpoint_wrapper`` it adds no module, so parameter names stay the same."""
    if not getattr(policy, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"`activation_checkpointing` is True, but the policy ({type(policy).__name__}) does not support "
            "Hugging Face gradient checkpointing; set it to False."
        )
    if hasattr(policy, "activation_checkpointing_enable"):  # transformers >= 5.x
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def shard_policy(
    policy: nn.Module,
    device_mesh: Any,
    *,
    activation_checkpointing: bool = False,
    mixed_precision: Optional[str] = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard a Hugging Face causal LM in place over Lightning's ``ModelParallelStrategy`` mesh.

    Order: the TP plan (when the mesh's ``tensor_parallel`` size is > 1), then activation
    checkpointing, then ``fully_shard`` of every decoder layer and of the root over the
    ``data_parallel`` sub-mesh. Tied input/output embeddings stay tied: both modules sit in the
    root's FSDP group, which keeps one shared parameter.

    Arguments:
        policy: a Hugging Face ``PreTrainedModel`` (``model.layers`` decoder blocks for TP).
        device_mesh: a 2-D ``DeviceMesh`` with dims ``("data_parallel", "tensor_parallel")``.
        activation_checkpointing: recompute each decoder layer in backward (Hugging Face's
            non-reentrant gradient checkpointing).
        mixed_precision: ``bf16`` / ``fp16``: FSDP2 gathers and computes in that dtype and reduces
            gradients in float32 (the parameters and optimizer stay float32); None: no cast.
        reshard_after_forward: FSDP2's choice of freeing each layer's gathered parameters after
            forward (less memory, one more all-gather in backward).

    Returns:
        ``policy``, sharded (its parameters are DTensors).

    Raises:
        ConfigError: an unknown ``mixed_precision``, a mesh without the two named dims, or a TP
            size the policy cannot split over (see :func:`tp_head_layout`).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
        raise ConfigError(
            f"`mixed_precision` is {mixed_precision!r}; it must be null or one of {', '.join(MIXED_PRECISION)}."
        )
    dims = tuple(device_mesh.mesh_dim_names or ())
    if dims != ("data_parallel", "tensor_parallel"):
        raise ConfigError(
            f"The device mesh has dims {dims}; shard_policy needs ModelParallelStrategy's "
            "('data_parallel', 'tensor_parallel') mesh."
        )
    if isinstance(policy, FSDPModule):  # already sharded (configure_model may run twice)
        return policy
    keys = list(policy.state_dict())
    tp_mesh = device_mesh["tensor_parallel"]
    if tp_mesh.size() > 1:
        _parallelize_layers(policy, tp_mesh)
    if activation_checkpointing:
        _enable_activation_checkpointing(policy)
    mp = MixedPrecisionPolicy()
    if mixed_precision is not None:
        mp = MixedPrecisionPolicy(param_dtype=MIXED_PRECISION[mixed_precision], reduce_dtype=torch.float32)
    dp_mesh = device_mesh["data_parallel"]
    for layer in _decoder_layers(policy):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(policy, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if list(policy.state_dict()) != keys:  # a wrapper that renamed parameters would break sync and checkpoints
        raise RuntimeError("Sharding changed the policy's parameter names; this is a bug in shard_policy.")
    return policy

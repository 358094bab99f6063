"""RolloutRuntime: the engines, the agent flow, the datasource and the step-protocol controller for
one training run. The Lightning callback and the Fabric loop both build one; neither starts
engines or syncs weights on its own.
"""

from __future__ import annotations

import asyncio
from typing import Mapping, Optional

import torch

from lightning_fasync.config import FasyncConfig
from lightning_fasync.lightning.strategy import ResourcePlan, pin_trainer
from lightning_fasync.pipeline.controller import FullyAsyncController
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.engine import SamplingParams
from lightning_fasync.pipeline.flow import SingleTurnFlow
from lightning_fasync.pipeline.state import PipelineError


def engine_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights to push to the engines, under the names the engines' model uses.

    ``module.engine_state_dict()`` when the module defines it; otherwise the state dict of the
    Hugging Face model it holds (a user module wraps one, e.g. ``self.policy``), so the names carry
    no prefix of the wrapper.
    """
    inner = getattr(module, "module", module)  # Fabric's wrapper
    if hasattr(inner, "engine_state_dict"):
        return inner.engine_state_dict()
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedModel = ()  # type: ignore[assignment]
    if isinstance(inner, PreTrainedModel):
        return {k: v.detach() for k, v in inner.state_dict().items()}
    found = [m for m in inner.children() if isinstance(m, PreTrainedModel)]
    if len(found) != 1:
        raise PipelineError(
            f"Cannot tell which weights the engines serve: {type(inner).__name__} holds {len(found)} Hugging Face "
            "models; define engine_state_dict() on it."
        )
    return {k: v.detach() for k, v in found[0].state_dict().items()}


class RolloutRuntime:
    """Start the rollout side of a run; stop it idempotently.

    Arguments:
        cfg: the validated plugin config.
        engine_model: what the engines load (the policy's preset name or local directory).
        plan: the resource split (cores per engine replica and for the trainer).
        log_dir: where ``events.jsonl`` and ``ledger.jsonl`` go.
        pin: pin this (trainer) process to ``plan.trainer_cores`` after the engines start.
        engine_threads: torch threads per engine (default: its core count).
        engine_startup_timeout: seconds each replica has to become healthy.
        admin_timeout: seconds one weight sync may take.
    """

    def __init__(
        self,
        cfg: FasyncConfig,
        engine_model: str,
        plan: ResourcePlan,
        log_dir: Optional[str],
        pin: bool = True,
        engine_threads: Optional[int] = None,
        engine_startup_timeout: float = 180.0,
        admin_timeout: float = 600.0,
    ) -> None:
        from lightning_fasync.data.tasks import make_task
        from lightning_fasync.rollout.pool import RolloutPool

        self.cfg = cfg
        self.admin_timeout = admin_timeout
        self._closed = False
        task = make_task(cfg.data_source.task, **cfg.data_source.task_args)
        self.task = task
        prompts = task.make_prompts(cfg.data_source.num_prompts, cfg.data_source.seed)
        threads = engine_threads or max(1, len(plan.replica_cores[0]))
        self.pool = RolloutPool(
            engine_model,
            num_replicas=plan.num_replicas,
            threads_per_replica=threads,
            max_running_requests=cfg.rollout.sglang_args.max_running_requests,
            cpu_cores=plan.replica_cores,
            context_length=max(len(p) for p, _ in prompts) + cfg.rollout.max_response_length + 1,
            startup_timeout=engine_startup_timeout,
        ).start()
        try:
            if pin:
                # Engines first (each pins itself), then the trainer's own pinning.
                pin_trainer(plan.trainer_cores)
            client = self.pool.client(max_connections=cfg.agentflow.router.max_connections)
            sampling = SamplingParams(
                temperature=cfg.rollout.temperature,
                top_p=cfg.rollout.top_p,
                top_k=cfg.rollout.top_k,
                stop_token_ids=list(task.stop_token_ids),
            )
            flow = SingleTurnFlow(client, sampling, cfg.rollout.max_response_length, reward_fn=task.reward)
            datasource = ListDataSource(prompts, shuffle=cfg.data_source.shuffle, seed=cfg.data_source.seed)
            self.controller = FullyAsyncController(cfg, datasource, flow, client, log_dir=log_dir)
        except BaseException:
            self.pool.stop()
            raise

    def sync_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Push ``tensors`` to every engine as ``version`` (they flush their caches)."""
        pool = self.pool

        async def push() -> None:
            client = pool.client()
            try:
                await asyncio.wait_for(client.update_weights_from_tensor(tensors, weight_version=version), self.admin_timeout)
            finally:
                await client.close()

        try:
            asyncio.run(push())
        except asyncio.TimeoutError:
            raise PipelineError(f"The weight sync to the engines took longer than {self.admin_timeout:.0f} s.") from None

    def shutdown(self, raise_errors: bool = True) -> None:
        """Stop the pipeline threads, then the engines (by pid). Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            self.controller.shutdown(raise_errors=raise_errors)
        except BaseException as exc:  # noqa: BLE001 - stop the engines too, then report
            errors.append(exc)
        try:
            self.pool.stop()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        if raise_errors and errors:
            raise errors[0]

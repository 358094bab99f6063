"""``rollout.check_weights`` (``lightning_fasync/weights/probe.py``): after a push, each engine's
log-probs of a fixed probe, served by the embedded engine in process over SGLang's ``/generate``,
held against those computed here from the pushed tensors. A push the engine serves passes; an
engine that serves other weights (an update it dropped, another adapter) fails it, naming the
engine; what the check cannot do is refused naming the key."""

import copy
import glob
import os
import subprocess
import sys

import pytest
import torch

from lightning_fasync.config import ConfigError, FasyncConfig, validate
from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.policy import build_policy
from lightning_fasync.weights.lora_sync import AdapterWeightSync
from lightning_fasync.weights.probe import probe_ids, sglang_served_logprobs
from lightning_fasync.weights.sync import TensorWeightSync, WeightSyncError
from lightning_fasync.weights.tensor_stream import TensorStream
from tests.helpers.engine import serve
from tests.helpers.paths import REPO

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"], "sync": "adapter"}


def perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


class DroppedUpdate(TensorWeightSync):
    """A push whose engines answer but never load the weights (what the check is for)."""

    async def _send(self, staged, version, where):
        return None


def test_a_checked_push_passes_and_an_engine_serving_other_weights_fails_naming_it():
    policy = build_policy("tiny")
    w1, w2 = perturbed(policy[0], 1), perturbed(policy[0], 2)

    async def body(session, url, engine):
        sync = TensorWeightSync(SGLangClient([url]), check_model="tiny")
        dropped = DroppedUpdate(SGLangClient([url]), check_model="tiny")
        try:
            await sync.push(w1, 1, step=0)  # served: the check passes
            assert 0 <= sync.last_check_gap < 1e-3
            # The served log-probs are the reference's, within float32's tolerance.
            ids = probe_ids(int(w1["model.embed_tokens.weight"].shape[0]))
            served = await sglang_served_logprobs(sync.client, url, ids, 30.0)
            reference = copy.deepcopy(policy[0])
            reference.load_state_dict(w1)
            with torch.no_grad():
                logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0], dim=-1)
            assert max(abs(s - logp[i - 1, ids[i]].item()) for i, s in enumerate(served, start=1)) < 1e-4
            with pytest.raises(WeightSyncError, match=rf"The weight sync of step 1: the engine {url} does not serve "
                                                      r"the pushed weights.*tolerance 0\.001, `rollout\.check_weights`"):
                await dropped.push(w2, 2, step=1)
            await sync.check_pushed(w1, "weight version 1")  # the engine still serves w1
        finally:
            await sync.close()
            await dropped.close()

    serve(policy, body, own_model=True)


def test_the_adapter_path_checks_the_base_with_the_adapter_merged():
    modules = []
    for seed in (0, 1):
        module = RLPolicyModule("tiny", lora=LORA)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in module.policy.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if "lora_B" in name else 0.2))
        modules.append(module)
    ours, other = (m.engine_state_dict() for m in modules)

    async def body(session, url, engine):
        sync = AdapterWeightSync(SGLangClient([url]), check_model="tiny")
        try:
            await sync.push(ours, 1)  # the probe names the adapter (lora_path) and passes
            with pytest.raises(WeightSyncError, match="does not serve the pushed weights"):
                await sync.check_pushed(other, "weight version 2")
            no_base = type(ours)(dict(ours), ours.config)
            with pytest.raises(WeightSyncError, match="needs the adapter's base weights"):
                await sync.check_pushed(no_base, "weight version 2")
        finally:
            await sync.close()

    serve(build_policy("tiny"), body, own_model=True, app_kwargs={"enable_lora": True})


def test_a_stream_and_a_model_the_tensors_do_not_cover_are_refused_naming_the_key():
    policy = build_policy("tiny")
    weights = perturbed(policy[0], 3)

    async def body(session, url, engine):
        sync = TensorWeightSync(SGLangClient([url]), check_model="tiny")
        try:
            with pytest.raises(WeightSyncError, match="`rollout.check_weights`.*stream.*set it false with a sharded"):
                await sync.push(TensorStream.from_mapping(weights), 1)
            partial = {k: v for k, v in weights.items() if "layers.0." not in k}
            with pytest.raises(WeightSyncError, match="do not cover the policy 'tiny'; set it false"):
                await sync.check_pushed(partial, "weight version 1")
        finally:
            await sync.close()

    serve(policy, body, own_model=True)


def test_the_config_refuses_check_weights_with_vllm_servers_and_with_colocate_offload():
    cfg = FasyncConfig()
    cfg.rollout.check_weights = True
    cfg.rollout.backend = "vllm"
    with pytest.raises(ConfigError, match="`rollout.check_weights` is true while `rollout.backend` is vllm.*"
                                          "rollout.vllm_args.check_weights"):
        validate(cfg)
    cfg = FasyncConfig()
    cfg.rollout.check_weights = True
    cfg.rollout.backend, cfg.rollout.weight_sync = "external", "vllm"
    cfg.rollout.engine_urls = ["http://127.0.0.1:1"]
    with pytest.raises(ConfigError, match="`rollout.check_weights` is true while `rollout.weight_sync` is vllm"):
        validate(cfg)
    cfg = FasyncConfig()
    cfg.rollout.check_weights = True
    cfg.colocate, cfg.fully_async.enable, cfg.colocate_offload = True, False, True
    with pytest.raises(ConfigError, match="`colocate_offload` is true while `rollout.check_weights` is true"):
        validate(cfg)


@pytest.mark.slow
def test_a_fit_checks_every_push_and_logs_the_gap(tmp_path):
    """The main job's default path (``tensor``) with the check on, through the real CLI and an engine
    process: every step logs the last checked push's largest probe gap, within float32's tolerance."""
    from lightning_fasync.plots import read_scalars

    steps = 3
    proc = subprocess.run([sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", "configs/tiny_cpu.yaml",
                           f"--trainer.default_root_dir={tmp_path}", f"--trainer.rollout_steps={steps}",
                           "--trainer.enable_progress_bar=false", "--rollout.check_weights=true"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "weight sync `tensor`" in proc.stderr
    (log_dir,) = glob.glob(os.path.join(tmp_path, "lightning_logs", "version_*"))
    gaps = [v for _, v in read_scalars(log_dir)["weights/check_gap"]]
    assert len(gaps) == steps and all(0 <= g < 1e-3 for g in gaps), gaps

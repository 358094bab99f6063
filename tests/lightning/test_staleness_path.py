"""The off-policy path, end to end on real components: which weights and log-probs each term uses.

* ``old_log_probs`` (pi_prox) are the step-start weights for every training call of a step, under
  Lightning's real hook order (optimizer.step runs before on_train_batch_end, where the driver
  calls ``begin_rollout_step``).
* The loss is decoupled PPO: ``-w min(r A, clip(r) A)``, ``r = pi_theta / pi_prox`` (clip centred on
  pi_prox), ``w = min(pi_prox / mu, c)`` detached, token-mean over the original mask.
* The engine's log-probs (mu) are the trainer's recomputation at the weights that generated each
  token, also for a partial trajectory resumed after a weight update, whose tokens keep the
  version that generated them.
"""

import copy

import lightning.pytorch as pl
import torch

from lightning_fasync.algorithms import policy_loss
from lightning_fasync.config import AlgorithmConfig, FasyncConfig, ISCorrectionConfig
from lightning_fasync.lightning.batch import collate_groups, rollout_dataloader
from lightning_fasync.lightning.module import RLPolicyModule, token_log_probs
from lightning_fasync.pipeline.engine_client import GenerateResult, SamplingParams
from lightning_fasync.pipeline.flow import apply_result, continuation, resume_request
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus

CALLS_PER_STEP = 2


def _group(seed):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(4):
        t = Trajectory(
            prompt_id=PromptId(0, seed), sample_index=i, prompt_ids=[1, 10, 11],
            status=TrajectoryStatus.COMPLETED, reward=float(i),
        )
        t.extend(torch.randint(4, 20, (5,), generator=g).tolist(), [-1.0] * 5, [0] * 5)
        trajs.append(t)
    return TrajectoryGroup(PromptSample(PromptId(0, seed), [1, 10, 11]), seed, trajs)


def _checksum(module):
    return [p.detach().clone() for p in module.policy.parameters()]


class _DriverProbe(pl.Callback):
    """Calls ``begin_rollout_step`` and fills the batch where FullyAsyncCallback does: on_train_start
    and, at a step boundary, in on_train_batch_end (lightning_fasync/lightning/callback.py); keeps a
    frozen copy of each step's start weights."""

    def __init__(self):
        self.step, self.start, self.seen = 0, None, []

    def on_train_start(self, trainer, module):
        module.begin_rollout_step(0)
        self.start = copy.deepcopy(module.policy)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        batch.groups, batch.rollout_step = [_group(batch_idx)], self.step
        batch.call_index, batch.calls_per_step = batch_idx % CALLS_PER_STEP, CALLS_PER_STEP

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if (batch_idx + 1) % CALLS_PER_STEP == 0:
            self.step += 1
            module.begin_rollout_step(self.step)
            self.start = copy.deepcopy(module.policy)


class _Module(RLPolicyModule):
    def training_step(self, batch, batch_idx):
        import lightning_fasync.lightning.module as mod

        original, probe = mod.policy_loss, self.probe

        def observed(log_probs, old_log_probs, *args, **kwargs):
            data = collate_groups(batch.groups, self.tokenizer.pad_token_id)
            with torch.no_grad():
                want, _ = token_log_probs(probe.start, data, temperature=self.rollout_temperature)
            mask = data.response_mask.bool()
            probe.seen.append((batch.rollout_step, torch.allclose(old_log_probs[mask], want[mask], atol=1e-6),
                               old_log_probs.requires_grad))
            return original(log_probs, old_log_probs, *args, **kwargs)

        mod.policy_loss = observed
        try:
            return super().training_step(batch, batch_idx)
        finally:
            mod.policy_loss = original


def test_old_log_probs_use_the_step_start_weights_for_every_call_of_every_step(tmp_path):
    # The first call of a step takes them from its own forward (its weights are the step-start
    # ones), the later ones from the snapshot: either way the step-start policy's, detached.
    module = _Module("tiny", **RLPolicyModule.algorithm_args(FasyncConfig()))
    module.probe = probe = _DriverProbe()
    trainer = pl.Trainer(
        max_steps=2 * CALLS_PER_STEP, callbacks=[probe], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0, accelerator="cpu",
        default_root_dir=tmp_path,
    )
    first = _checksum(module)
    trainer.fit(module, train_dataloaders=rollout_dataloader())
    assert not all(torch.equal(a, b) for a, b in zip(first, _checksum(module)))  # the weights did move
    assert probe.seen == [(s, True, False) for s in range(2) for _ in range(CALLS_PER_STEP)]


def test_the_loss_is_decoupled_ppo_with_a_truncated_behaviour_weight():
    torch.manual_seed(0)
    B, T = 32, 12
    mu = -torch.rand(B, T) * 3
    prox = mu + torch.randn(B, T) * 0.7
    lp = (prox + torch.randn(B, T) * 0.3).requires_grad_()
    adv = torch.randn(B)
    mask = (torch.rand(B, T) > 0.2).float()
    loss, _ = policy_loss(lp, prox, mu, adv, mask,
                          AlgorithmConfig(dual_clip=None, is_correction=ISCorrectionConfig(enable=True, c=2.0)))
    w = torch.clamp(torch.exp(prox - mu), max=2.0)
    r = torch.exp(lp - prox)
    a = adv[:, None]
    ref = ((-w * torch.min(r * a, r.clamp(0.8, 1.28) * a)) * mask).sum() / mask.sum()
    g, = torch.autograd.grad(loss, lp)
    g_ref, = torch.autograd.grad(ref, lp)
    assert torch.allclose(loss, ref, atol=1e-6) and torch.allclose(g, g_ref, atol=1e-7)


def test_engine_log_probs_match_the_trainer_at_each_tokens_version_across_a_resume():
    from lightning_fasync.policy import build_policy
    from lightning_fasync.fleet.client import parse_version
    from lightning_fasync.engine.engine import Engine

    torch.manual_seed(0)
    pol0, tok = build_policy("tiny")
    pol1 = copy.deepcopy(pol0)
    with torch.no_grad():
        for p in pol1.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine = Engine(copy.deepcopy(pol0), seed=0)
    try:
        sample = PromptSample(PromptId(0, 0), [1, 10, 11, 12])
        sp = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
        first = []
        for j in range(3):  # version 0: 5 tokens, then aborted at the step boundary
            t = continuation(sample, j, 0)
            r = engine.generate(resume_request(t, sp, 12, "a").input_ids, max_new_tokens=5, ignore_eos=True)
            apply_result(t, GenerateResult("a", r.output_ids, r.output_logprobs, [parse_version(v) for v in r.output_versions], "abort"), 12)
            first.append(t)
        engine.update_weights(pol1.state_dict(), weight_version="1")
        resumed = PromptSample(sample.prompt_id, sample.input_ids, resume=first)
        done = []
        for j in range(3):
            t = continuation(resumed, j, 1)
            req = resume_request(t, sp, 12, "b")
            r = engine.generate(req.input_ids, max_new_tokens=req.sampling_params.max_new_tokens, ignore_eos=True)
            apply_result(t, GenerateResult("b", r.output_ids, r.output_logprobs, [parse_version(v) for v in r.output_versions], "length"), 12)
            t.reward = 0.0
            done.append(t)
    finally:
        engine.stop()
    assert all(t.weight_versions == [0] * 5 + [1] * 7 and (t.start_version, t.end_version) == (0, 1) for t in done)
    data = collate_groups([TrajectoryGroup(resumed, 0, done)], tok.pad_token_id)
    with torch.no_grad():
        lp = {0: token_log_probs(pol0, data)[0], 1: token_log_probs(pol1, data)[0]}
    m = data.response_mask.bool()
    for version in (0, 1):
        sel = m & (data.weight_versions == version)
        assert sel.sum() > 0
        assert torch.allclose(lp[version][sel], data.rollout_log_probs[sel], atol=1e-4)
        assert not torch.allclose(lp[1 - version][sel], data.rollout_log_probs[sel], atol=1e-2)

"""A plain RL LightningModule, made fully-async by adding FullyAsyncCallback.

Run it (a couple of minutes on 2 CPU cores):  python examples/drop_in_callback.py

`ReinforcePolicy` is the kind of module people already have: a causal-LM policy, rewards, and a
REINFORCE loss with a per-prompt mean baseline. It knows nothing of engines or threads. Three
lines make it fully-async: the callback (engines, producer, collector, step protocol), the
rollout dataloader (complete prompt groups from the pipeline), and the FullyAsyncHooks base with
the name of the model the engines load (they receive the trainer's weights at every step
boundary; the hooks' defaults find the Hugging Face model the module holds).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.nn.utils.rnn import pad_sequence

from lightning_fasync.lightning import FullyAsyncCallback, FullyAsyncHooks, rollout_dataloader
from lightning_fasync.policy import build_policy


class ReinforcePolicy(FullyAsyncHooks, pl.LightningModule):
    """REINFORCE on (prompt, response, reward) with a per-prompt mean baseline."""

    engine_model = "tiny"  # what the rollout engines load; a local HF directory works too

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self._metrics: dict[str, float] = {}
        self.policy, self.tokenizer = build_policy("tiny")
        self.policy.train()

    def training_step(self, batch, batch_idx):
        losses, rewards = [], []
        for group in batch.groups:  # one group = the N responses to one prompt
            r = torch.tensor([t.reward for t in group.trajectories])
            advantage = r - r.mean()
            seqs = [torch.tensor(t.prompt_ids + t.response_ids) for t in group.trajectories]
            ids = pad_sequence(seqs, batch_first=True, padding_value=self.tokenizer.pad_token_id)
            logp = torch.log_softmax(self.policy(input_ids=ids).logits[:, :-1].float(), -1)
            logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            for i, t in enumerate(group.trajectories):
                p, n = len(t.prompt_ids), len(t.response_ids)
                losses.append(-advantage[i] * logp[i, p - 1 : p - 1 + n].sum() / max(n, 1))
            rewards.append(r.mean())
        loss = torch.stack(losses).mean()
        # One value per rollout step: rollout_metrics() hands the call's metrics to the callback,
        # which averages them over the step's training calls and logs them at the rollout step.
        self._metrics = {"train/loss": loss.item(), "train/reward": torch.stack(rewards).mean().item()}
        return loss

    def rollout_metrics(self):
        return self._metrics

    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.parameters(), lr=self.lr)


CONFIG = {
    "colocate": False,
    "fully_async": {"enable": True, "sliding_window": "windowed-fifo", "stale_steps": 1.0},
    "data_source": {"num_prompts_per_step": 16, "num_trajectories_per_prompt": 8, "task": "repeat"},
    "trainer": {"mini_batch_size": 32},
    "rollout": {"partial": True, "max_response_length": 65},
}


def main(rollout_steps: int = 60, root: str = "runs/drop_in") -> pl.Trainer:
    calls_per_step = 16 * 8 // 32
    trainer = pl.Trainer(
        max_steps=rollout_steps * calls_per_step,
        callbacks=[FullyAsyncCallback(CONFIG)],
        default_root_dir=root,
        gradient_clip_val=1.0,
        log_every_n_steps=calls_per_step,
    )
    trainer.fit(ReinforcePolicy(), train_dataloaders=rollout_dataloader())
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollout-steps", type=int, default=60)
    parser.add_argument("--root", default="runs/drop_in")
    args = parser.parse_args()
    main(args.rollout_steps, args.root)

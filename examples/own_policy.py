"""Your own policy, tokenizer, prompts and reward, made fully-async: under a plain Lightning
``Trainer`` (FullyAsyncCallback) or under Lightning Fabric (FullyAsyncFabricLoop).

Run it (a few minutes on 2 CPU cores):

    python examples/own_policy.py --driver trainer      # or --driver fabric
    python examples/own_policy.py --driver trainer --resume   # continue from its last checkpoint

Nothing here comes from the plugin's built-in task or presets:

- the tokenizer is a character-level Hugging Face tokenizer of its own, whose id 2 is the letter
  ``c`` and whose EOS is ``<eos>``; the model is a small Qwen2 built from a config, saved with the
  tokenizer and a generation config as a Hugging Face directory, which the rollout engines load;
- the prompts come from a ``DataSource`` of its own (``c3:`` asks for ``ccc`` then EOS) and the
  reward is a plain function over the decoded response; both are passed as objects;
- the loss is a GRPO-style policy gradient written here (group-normalised advantages, token mean).

The engines stop responses on the policy's own EOS (its tokenizer and generation config say
which), not on any built-in task's; a line at start says which ids are in force.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any, Optional, Sequence

import lightning as L
import lightning.pytorch as pl
import torch
from torch.nn.utils.rnn import pad_sequence

from lightning_fasync.lightning import FullyAsyncCallback, FullyAsyncFabricLoop, FullyAsyncHooks, rollout_dataloader
from lightning_fasync.pipeline.datasource import DataSource
from lightning_fasync.types import PromptId, PromptSample

LETTERS = "abc"  # id 2 is "c": a stop on id 2 would cut every "ccc" short
MAX_COUNT = 4
#: The plugin config, as a plain dict (load_config from lightning_fasync.config takes the same).
CONFIG = {
    "colocate": False,
    "fully_async": {"enable": True, "sliding_window": "windowed-fifo", "stale_steps": 1.0},
    "data_source": {"num_prompts_per_step": 8, "num_trajectories_per_prompt": 4},
    "trainer": {"mini_batch_size": 16, "save_freq": 1},
    # Responses end at the policy's own EOS (38 here); "stop_token_ids": [38] would say so explicitly.
    "rollout": {"partial": True, "max_response_length": MAX_COUNT + 3},
}
CALLS_PER_STEP = 8 * 4 // 16  # (B x N) // M training calls (optimizer steps) per rollout step


# ------------------------------------------------------------------ tokenizer and model


def build_tokenizer() -> Any:
    """A character-level tokenizer: letters first (``a`` = 0, ``b`` = 1, ``c`` = 2), digits, ``:``,
    then ``<pad>``, ``<eos>`` and ``<unk>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789:"
    vocab = {c: i for i, c in enumerate(chars)}
    for special in ("<pad>", "<eos>", "<unk>"):
        vocab[special] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def save_own_model(path: str, seed: int = 0) -> str:
    """Build a small Qwen2 for the tokenizer and save model, tokenizer and generation config."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path


# ------------------------------------------------------------------ prompts and reward


class RepeatPrompts(DataSource):
    """Endless prompts ``<letter><count>:`` whose answer is the letter ``count`` times. Prompt
    ``i`` is drawn from its own seeded RNG, so the position is the whole state (plus the recycled
    prompts, which are served first)."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tokenizer, self.seed = tokenizer, seed
        self._next = 0
        self._recycled: list[PromptSample] = []

    def next_sample(self) -> Optional[PromptSample]:
        if self._recycled:
            return self._recycled.pop(0)
        rng = random.Random(self.seed * 1_000_003 + self._next)
        letter, count = rng.choice(LETTERS), rng.randint(1, MAX_COUNT)
        ids = self.tokenizer(f"{letter}{count}:")["input_ids"]
        sample = PromptSample(PromptId(0, self._next), ids, {"answer": letter * count})
        self._next += 1
        return sample

    def recycle(self, samples: Sequence[PromptSample]) -> None:
        self._recycled = sorted([*self._recycled, *samples], key=lambda s: (s.prompt_id.epoch, s.prompt_id.index))

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._next, "recycled": [s.to_dict() for s in self._recycled]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next = int(state["next"])
        self._recycled = [PromptSample.from_dict(s) for s in state["recycled"]]

    @property
    def max_prompt_length(self) -> int:
        return 3


def reward(sample: PromptSample, trajectory: Any) -> float:
    """Per-letter credit for the decoded response, plus a share for stopping right after it."""
    want, got = sample.metadata["answer"], trajectory.metadata["response_text"]
    hits = sum(a == b for a, b in zip(got, want)) / max(len(want), len(got), 1)
    return 0.8 * hits + 0.2 * float(got == want and trajectory.status == "completed")


# ------------------------------------------------------------------ the policy module


class OwnPolicy(FullyAsyncHooks, pl.LightningModule):
    """A GRPO-style policy gradient on the model saved by :func:`save_own_model`."""

    def __init__(self, model_dir: str, lr: float = 3e-3) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.engine_model = model_dir  # the engines load this directory (then get the trainer's weights)
        self.lr = lr
        self.policy = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).train()
        self.pad_id = build_tokenizer().pad_token_id
        self._metrics: dict[str, float] = {}
        self.trained_on: list[tuple[str, tuple[int, ...]]] = []  # (status, response ids) of each trajectory

    def training_step(self, batch, batch_idx):
        trajs, advantages = [], []
        for group in batch.groups:  # one group = the N responses to one prompt
            r = torch.tensor([t.reward for t in group.trajectories])
            advantages.append((r - r.mean()) / (r.std() + 1e-6))
            trajs += group.trajectories
        advantage = torch.cat(advantages)
        seqs = [torch.tensor(t.prompt_ids + t.response_ids) for t in trajs]
        ids = pad_sequence(seqs, batch_first=True, padding_value=self.pad_id)
        logp = torch.log_softmax(self.policy(input_ids=ids).logits[:, :-1].float(), -1)
        logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = torch.zeros_like(logp)
        for i, t in enumerate(trajs):
            p, n = len(t.prompt_ids), len(t.response_ids)
            mask[i, p - 1 : p - 1 + n] = 1.0
            self.trained_on.append((t.status.value, tuple(t.response_ids)))
        loss = -(advantage[:, None] * logp * mask).sum() / mask.sum().clamp(min=1.0)  # token mean over the call
        self._metrics = {"train/loss": loss.item(), "train/reward": float(torch.tensor([t.reward for t in trajs]).mean())}
        return loss

    def rollout_metrics(self):
        return self._metrics  # averaged over the step's calls, logged at the rollout step

    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.parameters(), lr=self.lr)


# ------------------------------------------------------------------ the two drivers


def train_with_trainer(model_dir: str, rollout_steps: int, root: str, resume: bool = False,
                       module: Optional[OwnPolicy] = None) -> pl.Trainer:
    """A plain ``Trainer.fit``: the callback, the rollout dataloader; ``max_steps`` counts training calls."""
    tokenizer = build_tokenizer()
    module = module or OwnPolicy(model_dir)
    trainer = pl.Trainer(
        max_steps=rollout_steps * CALLS_PER_STEP,
        callbacks=[FullyAsyncCallback(CONFIG, datasource=RepeatPrompts(tokenizer), reward=reward)],
        logger=pl.loggers.CSVLogger(root),
        default_root_dir=root,
        gradient_clip_val=1.0,
        log_every_n_steps=1,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=rollout_dataloader(), ckpt_path="last" if resume else None)
    return trainer


def train_with_fabric(model_dir: str, rollout_steps: int, root: str, resume: bool = False) -> FullyAsyncFabricLoop:
    """Lightning Fabric: the loop does backward, clipping, the optimizer and scheduler steps."""
    tokenizer = build_tokenizer()
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=L.fabric.loggers.CSVLogger(root))
    loop = FullyAsyncFabricLoop(fabric, CONFIG, log_dir=root, datasource=RepeatPrompts(tokenizer), reward=reward)
    module = OwnPolicy(model_dir)
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda call: max(0.1, 1 - call / 400))
    state = None
    if resume:
        rest = fabric.load(loop.files.last(), {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler})
        state = rest["fasync"]
    loop.fit(model, optimizer, rollout_steps, state=state, gradient_clip_val=1.0, lr_scheduler=scheduler)
    return loop


def main(driver: str = "trainer", rollout_steps: int = 60, root: str = "runs/own_policy", resume: bool = False) -> Any:
    model_dir = save_own_model(os.path.join(root, "model"))
    if driver == "trainer":
        return train_with_trainer(model_dir, rollout_steps, os.path.join(root, "trainer"), resume)
    return train_with_fabric(model_dir, rollout_steps, os.path.join(root, "fabric"), resume)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--driver", choices=["trainer", "fabric"], default="trainer")
    parser.add_argument("--rollout-steps", type=int, default=60)
    parser.add_argument("--root", default="runs/own_policy")
    parser.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    args = parser.parse_args()
    main(args.driver, args.rollout_steps, args.root, args.resume)

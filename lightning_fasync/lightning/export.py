"""``lightning-fasync export``: a trained policy out of a Lightning checkpoint, as a Hugging Face
directory (config, safetensors weights, tokenizer) that ``transformers`` and ``lightning-fasync
serve`` load.

The checkpoint is read with ``torch.load(weights_only=True)``. The policy is rebuilt from the
module's ``model`` hyperparameter (a preset or a Hugging Face directory: what ``RLPolicyModule``
was built from, or ``--model``), its weights are the checkpoint's ``policy.*`` tensors, every one of
them checked against the model's own names and shapes.

    lightning-fasync export --ckpt_path runs/tiny_cpu/lightning_logs/version_0/checkpoints/last.ckpt --out trained
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

import torch

from lightning_fasync.config import ConfigError

__all__ = ["export_checkpoint", "main"]

PREFIX = "policy."
"""``RLPolicyModule`` keeps the Hugging Face model as ``self.policy``."""


def export_checkpoint(ckpt_path: str, out: str, model: Optional[str] = None, prefix: str = PREFIX,
                      overwrite: bool = False) -> str:
    """Write the policy of a checkpoint to ``out`` as a Hugging Face directory; returns ``out``.

    Args:
        ckpt_path: A checkpoint written by ``lightning-fasync fit`` (single device or DDP).
        out: The directory to write (created; it must be empty unless ``overwrite``).
        model: The policy to rebuild (preset or Hugging Face directory); default: the checkpoint's
            ``model`` hyperparameter.
        prefix: The policy's prefix in the checkpoint's ``state_dict``.
        overwrite: Write into a non-empty ``out``.

    Raises:
        ConfigError: a missing or unreadable checkpoint, no model to rebuild, a non-empty ``out``,
            or weights whose names or shapes are not the model's (named in the message).
    """
    from lightning_fasync.policy import build_policy, save_policy

    if not os.path.isfile(ckpt_path):
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} is not a file.")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ConfigError(f"`--out` {out!r} exists and is not empty; choose another directory or pass --overwrite.")
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one message
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} cannot be read as a checkpoint: {exc}") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} has no `state_dict`: it is not a Lightning checkpoint.")
    hparams: dict[str, Any] = ckpt.get("hyper_parameters") or {}
    name = model or hparams.get("model")
    if not name:
        raise ConfigError(
            f"`--ckpt_path` {ckpt_path!r} does not say which policy it trained (no `model` hyperparameter); "
            "pass --model (a preset or a Hugging Face directory)."
        )
    policy, tokenizer = build_policy(str(name))
    theirs = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    mine = policy.state_dict()
    missing = sorted(set(mine) - set(theirs))
    unexpected = sorted(set(theirs) - set(mine))
    shapes = sorted(k for k in set(mine) & set(theirs) if tuple(mine[k].shape) != tuple(theirs[k].shape))
    if missing or unexpected or shapes:
        def few(keys: list[str]) -> str:
            return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

        problems = [f"{len(missing)} of the model's tensors are missing ({few(missing)})" if missing else "",
                    f"{len(unexpected)} are not the model's ({few(unexpected)})" if unexpected else "",
                    f"{len(shapes)} have another shape ({few(shapes)})" if shapes else ""]
        raise ConfigError(
            f"The checkpoint's `{prefix}*` weights do not fit {name!r}: " + "; ".join(p for p in problems if p)
            + ". Pass the --model it was trained from (and --prefix if the module names it otherwise)."
        )
    policy.load_state_dict({k: v.to(mine[k].dtype) for k, v in theirs.items()})
    return save_policy(policy, tokenizer, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-fasync export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by `lightning-fasync fit`")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--model", default=None, help="the policy it trained (default: the checkpoint's `model`)")
    parser.add_argument("--prefix", default=PREFIX, help=f"the policy's prefix in the state_dict (default {PREFIX!r})")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = export_checkpoint(args.ckpt_path, args.out, model=args.model, prefix=args.prefix, overwrite=args.overwrite)
    print(f"Wrote {out}: transformers.AutoModelForCausalLM.from_pretrained({out!r}) loads it, "
          f"and `lightning-fasync serve --model {out}` serves it.")
    return 0

"""Checkpoint files: atomic saves, a ``last.ckpt`` link, retention, and the run's identity.

A save writes ``step-NNNNNN.ckpt`` (a file, or a distributed checkpoint's directory, whose
every rank writes its part) under a temporary name, fsyncs it, renames it into place and
fsyncs the directory; only then does ``last.ckpt`` move to it (a relative symlink, replaced
atomically; a one-line pointer file ``last.ckpt.path`` where links are unavailable) and are
periodic checkpoints beyond ``trainer.save_keep_last`` removed. A kill or a full disk during a save
therefore leaves the previous checkpoint and ``last.ckpt`` intact; the failure is a
:class:`CheckpointError` naming the path and the cause.

The run's identity (:func:`run_identity`) goes into every checkpoint; :func:`check_resume` compares
it with the resuming run's: a change that breaks exactly-once prompt accounting is refused in one
sentence naming the key, any other change is listed in a warning.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import shutil
import warnings
from dataclasses import asdict
from typing import Any, Callable, Mapping, Optional

from lightning_fasync.config import ConfigError, FasyncConfig

LAST = "last.ckpt"
POINTER = LAST + ".path"
_STEP_FILE = re.compile(r"^step-(\d+)\.ckpt$")

# Keys whose change between save and resume breaks exactly-once accounting: the pipeline state in
# the checkpoint (buffer, ledger positions, prompt order, partial trajectories) was built with them.
ACCOUNTING_KEYS = (
    "colocate", "fully_async.enable", "fully_async.sliding_window", "fully_async.stale_steps",
    "data_source.num_prompts_per_step", "data_source.num_trajectories_per_prompt", "data_source.task",
    "data_source.num_prompts", "data_source.seed", "data_source.shuffle", "data_source.datasource",
    "data_source.datasource_args", "trainer.mini_batch_size", "rollout.partial", "rollout.sampler.num_oversample",
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one is intact."""


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    """fsync a checkpoint file, or a distributed checkpoint's directory and every file in it."""
    if os.path.isdir(path):
        for root, _, files in os.walk(path):
            for name in files:
                _fsync(os.path.join(root, name))
            _fsync(root)
    else:
        _fsync(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _replace(src: str, dst: str) -> None:
    """``os.replace`` for a file or a directory (a directory in the way is moved aside first, then removed)."""
    if os.path.isdir(dst) and not os.path.islink(dst):
        aside = f"{dst}.old-{os.getpid()}"
        os.replace(dst, aside)
        os.replace(src, dst)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(src, dst)


class CheckpointFiles:
    """The checkpoints of one run directory (``<log_dir>/checkpoints``).

    Arguments:
        directory: where the checkpoints go.
        keep_last: periodic checkpoints kept (``trainer.save_keep_last``); None keeps all.
    """

    def __init__(self, directory: str, keep_last: Optional[int]) -> None:
        self.directory = directory
        self.keep_last = keep_last

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step:06d}.ckpt")

    def hf_path(self, step: int) -> str:
        """Where ``trainer.save_hf`` writes step ``step``'s Hugging Face directory (pruned with it)."""
        return os.path.join(self.directory, f"step-{step:06d}.hf")

    def save(self, step: int, write: Callable[[str], None], is_writer: bool = True) -> str:
        """Write step ``step``'s checkpoint through ``write(path)``, atomically; returns its path.

        ``write`` is called on every rank (a collective in DDP); ``is_writer`` says whether this
        rank's call writes the file (Lightning and Fabric write on global rank 0) and so whether it
        renames, links and prunes.

        Raises:
            CheckpointError: the write or the rename failed (the disk is full, say); the previous
                checkpoint and ``last.ckpt`` are untouched and the partial file is removed.
        """
        final = self.path(step)
        tmp = os.path.join(self.directory, f".step-{step:06d}.ckpt.tmp-{os.getpid()}")
        if is_writer:
            os.makedirs(self.directory, exist_ok=True)
        try:
            write(tmp)
            if is_writer:
                _fsync_tree(tmp)
                _replace(tmp, final)
                _fsync(self.directory)
        except OSError as exc:
            if is_writer and os.path.lexists(tmp):
                _remove(tmp)
            cause = errno.errorcode.get(exc.errno, "") if exc.errno else ""
            try:
                previous = self.last()
            except CheckpointError:  # a link left broken by someone else: the save's own error is the one to tell
                previous = None
            raise CheckpointError(
                f"Saving the step-{step} checkpoint to {final} failed: {exc.strerror or exc}"
                + (f" ({cause})" if cause else "") + ". "
                + (f"The previous checkpoint {previous} is intact." if previous else "No earlier checkpoint exists.")
            ) from exc
        if is_writer:
            self._link_last(final)
            self._prune(keep=final)
        return final

    def last(self) -> Optional[str]:
        """The checkpoint ``last.ckpt`` points to, or None.

        Raises:
            CheckpointError: the link or the pointer file names something outside the directory
                or not a step checkpoint (they are written here with a step file's name).
        """
        link = os.path.join(self.directory, LAST)
        if os.path.islink(link) or os.path.isfile(link):
            if not os.path.exists(link):
                return None
            target = os.path.realpath(link)
            if os.path.islink(link) and os.path.dirname(target) != os.path.realpath(self.directory):
                raise CheckpointError(f"{link} points to {target}, outside {self.directory}; remove it or point it at a "
                                      "checkpoint of this directory.")
            return target
        pointer = os.path.join(self.directory, POINTER)
        if os.path.isfile(pointer):
            name = open(pointer).read(4096).strip()
            if os.path.basename(name) != name or not _STEP_FILE.match(name):
                raise CheckpointError(f"{pointer} names {name[:200]!r}, which is not a step checkpoint's file name "
                                      "(step-<N>.ckpt) in its directory; remove it or write one there.")
            target = os.path.join(self.directory, name)
            return target if os.path.exists(target) else None
        return None

    def steps(self) -> list[tuple[int, str]]:
        """``(step, path)`` of the periodic checkpoints, oldest first."""
        found = []
        for path in glob.glob(os.path.join(self.directory, "step-*.ckpt")):
            m = _STEP_FILE.match(os.path.basename(path))
            if m:
                found.append((int(m.group(1)), path))
        return sorted(found)

    def _link_last(self, target: str) -> None:
        name = os.path.basename(target)
        tmp = os.path.join(self.directory, f".{LAST}.tmp-{os.getpid()}")
        try:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            os.symlink(name, tmp)
            os.replace(tmp, os.path.join(self.directory, LAST))
        except OSError:  # no symlinks here (some network and Windows filesystems): a pointer file
            with open(tmp, "w") as f:
                f.write(name + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.directory, POINTER))
        _fsync(self.directory)

    def _prune(self, keep: str) -> None:
        if self.keep_last is None:
            return
        old = [(step, path) for step, path in self.steps() if path != keep]
        for step, path in old[: max(0, len(old) - (self.keep_last - 1))]:
            _remove(path)
            if os.path.isdir(self.hf_path(step)):
                _remove(self.hf_path(step))


def find_last(root: str) -> Optional[str]:
    """The newest run's last checkpoint under ``root`` (``--ckpt_path last``), or None."""
    dirs = {os.path.dirname(p) for p in glob.glob(os.path.join(root, "**", "checkpoints", LAST + "*"), recursive=True)}
    found = [c for c in (CheckpointFiles(d, None).last() for d in dirs) if c]
    return max(found, key=os.path.getmtime) if found else None


# ------------------------------------------------------------------------------ run identity


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), sub, out)
    else:
        out[prefix] = value


def run_identity(cfg: FasyncConfig, model: Any = None) -> dict[str, Any]:
    """What a checkpoint records about its run: the flattened plugin config and the model's shape
    (parameter names and global shapes: a module whose state dict holds shards, as
    ``MegatronPolicyModule``'s, says them with ``policy_shapes()``)."""
    config: dict[str, Any] = {}
    settings = asdict(cfg)
    # The source the run reads, under ``data_source.*`` either way it was given, so that
    # ACCOUNTING_KEYS compare it (``data_sources``, a list, would be one opaque value).
    settings["data_source"] = asdict(cfg.sources[0]) if cfg.sources else settings["data_source"]
    settings.pop("data_sources", None)
    _flatten("", settings, config)
    shape = None
    if model is not None and callable(getattr(model, "policy_shapes", None)):
        shape = model.policy_shapes()
    elif model is not None:
        shape = {name: list(p.shape) for name, p in model.state_dict().items()}
    return {"config": config, "model_shape": shape}


def check_resume(saved: Optional[Mapping[str, Any]], current: Mapping[str, Any], where: str) -> None:
    """Refuse a resume that breaks exactly-once accounting; warn about any other change.

    Args:
        saved: the checkpoint's :func:`run_identity` (None: a checkpoint from before identities,
            which is not checked).
        current: this run's identity.
        where: the checkpoint's path, for the messages.

    Raises:
        ConfigError: a key of :data:`ACCOUNTING_KEYS` or the model's shape differs.
    """
    if not saved:
        return
    old, new = saved.get("config", {}), current.get("config", {})
    for key in ACCOUNTING_KEYS:
        if old.get(key) != new.get(key):
            raise ConfigError(
                f"`{key}` is {new.get(key)!r} but the checkpoint {where} was saved with {old.get(key)!r}; resuming "
                "with a different value would break exactly-once prompt accounting: resume with the saved value "
                "or start a new run."
            )
    if saved.get("model_shape") and current.get("model_shape") and saved["model_shape"] != current["model_shape"]:
        a, b = saved["model_shape"], current["model_shape"]
        diff = sorted(set(a) ^ set(b)) or sorted(k for k in a if a[k] != b.get(k))
        raise ConfigError(
            f"`model.model` builds a policy whose shape differs from the one in the checkpoint {where} "
            f"(first difference: {diff[0]!r}); resume with the same model."
        )
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
        listed = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:12])
        more = f" and {len(changed) - 12} more" if len(changed) > 12 else ""
        warnings.warn(f"Resuming from {where} with changed settings: {listed}{more}.", stacklevel=2)


def check_hparams(saved: Optional[Mapping[str, Any]], current: Mapping[str, Any], where: str) -> None:
    """Warn about changed module hyperparameters (``model.*``: a learning rate, say)."""
    if not saved:
        return
    changed = sorted(k for k in set(saved) | set(current) if k != "algorithm" and saved.get(k) != current.get(k))
    if changed:
        listed = ", ".join(f"model.{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
        warnings.warn(f"Resuming from {where} with changed settings: {listed}.", stacklevel=2)


# ------------------------------------------------------------------------------ trainer.save_hf


def save_hf(weights: Any, model: Optional[str], out: str, is_writer: bool) -> None:
    """``trainer.save_hf``: write the policy beside its checkpoint as a Hugging Face directory.

    Every rank calls this with what ``engine_state_dict()`` gave it: a stream (a sharded module)
    is gathered by every rank, and only ``is_writer`` (global rank 0) keeps and writes the
    tensors, shard by shard; the others drain it. A mapping is written as it is; a LoRA adapter
    (:class:`~lightning_fasync.lora.AdapterWeights`, ``model.lora.sync: adapter``) is written in
    peft's format (``adapter_config.json`` + ``adapter_model.safetensors``).
    """
    from lightning_fasync.lora import AdapterWeights, write_adapter_dir
    from lightning_fasync.weights.tensor_stream import TensorStream

    if isinstance(weights, AdapterWeights):
        if is_writer:
            if os.path.isdir(out):  # this step's, from a run that stopped after writing it
                shutil.rmtree(out)
            tmp = f"{out}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            write_adapter_dir(dict(weights), weights.config, tmp)
            os.replace(tmp, out)
        return
    stream = weights if isinstance(weights, TensorStream) else None
    try:
        if is_writer:
            from lightning_fasync.export.hf import save_hf_from_stream
            from lightning_fasync.weights.sync import unique_tensors

            if not model:
                raise ConfigError("`trainer.save_hf` needs to know the policy's model (the module's engine_model).")
            if os.path.isdir(out):  # this step's, from a run that stopped after writing it
                shutil.rmtree(out)
            save_hf_from_stream(stream if stream is not None else TensorStream.from_mapping(unique_tensors(weights)),
                                model, out)
    finally:
        if stream is not None:  # the other ranks' gathers need this rank's part, whatever happened
            stream.drain()

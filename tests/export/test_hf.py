"""`lightning-fasync export`: a checkpoint's policy as a Hugging Face directory, and
`save_hf_from_stream`, the writer behind it and `trainer.save_hf`.

The end-to-end case of a single-device run (a real `fit` checkpoint, loaded back with `transformers`)
is in tests/integration/test_fit.py::test_embedded_default_learns_end_to_end; the one of a sharded run
(Lightning's `ModelParallelStrategy`, FSDP2 on 2 CPU processes) is here, marked slow; the others
check the contracts on checkpoint-shaped files and directories."""

import inspect
import os

import pytest
import torch

from lightning_fasync.cli import main
from lightning_fasync.policy import build_policy


def _checkpoint(path, model="tiny", prefix="policy.", drop=None):
    torch.manual_seed(0)
    policy, _ = build_policy(model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the preset's weights
    state = {prefix + k: v for k, v in policy.state_dict().items() if k != drop}
    torch.save({"state_dict": state, "hyper_parameters": {"model": model}, "epoch": 0}, path)
    return policy


def test_export_writes_a_directory_transformers_loads_with_the_checkpoints_weights(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    policy = _checkpoint(tmp_path / "a.ckpt")
    out = tmp_path / "hf"
    assert main(["export", "--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(out)]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (k, a), (k2, b) in zip(sorted(policy.state_dict().items()), sorted(loaded.state_dict().items())):
        assert k == k2 and torch.equal(a, b), k
    again, tok = build_policy(str(out))  # what `lightning-fasync serve --model DIR` loads
    ids = torch.tensor([tok("<s>g*3=")["input_ids"]])
    assert torch.allclose(again(ids).logits, policy(ids).logits, atol=1e-6)


def test_export_refuses_what_it_cannot_do_in_one_sentence(tmp_path, capsys):
    _checkpoint(tmp_path / "a.ckpt")
    _checkpoint(tmp_path / "short.ckpt", drop="lm_head.weight")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        (["--ckpt_path", str(tmp_path / "none.ckpt"), "--out", str(tmp_path / "o1")], "does not exist"),
        (["--ckpt_path", str(tmp_path / "full"), "--out", str(tmp_path / "o1")], "directory without `.metadata`"),
        (["--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "full" / "x")], "is not a directory"),
        (["--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "full")], "exists and is not empty"),
        (["--ckpt_path", str(tmp_path / "short.ckpt"), "--out", str(tmp_path / "o2")], "1 of the model's tensors are missing (lm_head.weight)"),
        (["--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "o3"), "--prefix", "model."], "missing"),
    ]
    for args, words in cases:
        assert main(["export", *args]) == 2, args
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (args, err)
    assert main(["export", "--ckpt_path", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "full"), "--overwrite"]) == 0


# ------------------------------------------------------------------------------ save_hf_from_stream


def _perturbed(model="tiny"):
    torch.manual_seed(1)
    policy, tok = build_policy(model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return policy, tok


def _tied_tiny_dir(path):
    """The tiny preset with tied embeddings, as a Hugging Face directory."""
    from transformers import AutoModelForCausalLM

    from lightning_fasync.policy import save_policy

    base, tok = build_policy("tiny")
    config = base.config
    config.tie_word_embeddings = True
    torch.manual_seed(2)
    save_policy(AutoModelForCausalLM.from_config(config).eval(), tok, str(path))
    return str(path)


def _logits(model, tok):
    ids = torch.tensor([tok("<s>g*3=")["input_ids"]])
    with torch.no_grad():
        return model(ids).logits


def test_save_hf_from_stream_writes_shards_one_at_a_time_that_transformers_loads(tmp_path, monkeypatch):
    import json

    import safetensors.torch
    from transformers import AutoModelForCausalLM

    from lightning_fasync.export.hf import save_hf_from_stream
    from lightning_fasync.weights.tensor_stream import TensorStream

    policy, tok = _perturbed()
    state = policy.state_dict()
    limit = 200_000  # the tiny policy is ~1.2 MB: several shards, and embed/lm_head fit in one
    # What the writer holds: taken from the stream and not yet written to a shard. When the next
    # tensor is taken, that must be at most one shard.
    held = {"bytes": 0, "max": 0}
    inner = TensorStream.from_mapping(state)

    def produce(i):
        held["max"] = max(held["max"], held["bytes"])
        tensor = inner._produce(i)
        held["bytes"] += tensor.nbytes
        return tensor

    real_save = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        held["bytes"] -= sum(t.nbytes for t in tensors.values())
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    stream = TensorStream(inner.specs, produce)
    out = tmp_path / "hf"
    assert save_hf_from_stream(stream, "tiny", str(out), max_shard_bytes=limit) == str(out)
    assert stream.consumed == len(stream) and held["bytes"] == 0 and 0 < held["max"] <= limit

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    n = len(shards)
    assert n >= 4 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(state) and "lm_head.weight" in index["weight_map"]  # not tied: written
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
    for f in shards:  # by the limit, but for a tensor larger than it, alone in its file
        names = [k for k, v in index["weight_map"].items() if v == f]
        assert sum(state[k].nbytes for k in names) <= limit or len(names) == 1, f
    assert not [f for f in os.listdir(tmp_path) if f != "hf"]  # no temporary directory left
    (tmp_path / "plain").mkdir()  # the same permissions as any directory (not a private temp dir's)
    assert os.stat(out).st_mode == os.stat(tmp_path / "plain").st_mode
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(_logits(loaded, tok), _logits(policy, tok))
    again, tok2 = build_policy(str(out))  # what `lightning-fasync serve --model DIR` loads
    assert tok2("<s>g*3=")["input_ids"] == tok("<s>g*3=")["input_ids"]

    # Again into the same directory, in one file: the earlier shards and index go, so the new
    # weights are what loads.
    with pytest.raises(ValueError, match="exists and is not empty"):
        save_hf_from_stream(TensorStream.from_mapping(state), "tiny", str(out))
    policy2, _ = _perturbed()
    with torch.no_grad():
        policy2.lm_head.weight.mul_(2)
    save_hf_from_stream(TensorStream.from_mapping(policy2.state_dict()), "tiny", str(out), overwrite=True)
    assert sorted(f for f in os.listdir(out) if f.startswith("model")) == ["model.safetensors"]
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out), tok), _logits(policy2, tok))


def test_save_hf_from_stream_tied_weights_are_written_once_and_load(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lightning_fasync.export.hf import save_hf_from_stream
    from lightning_fasync.weights.tensor_stream import TensorStream
    from lightning_fasync.weights.sync import unique_tensors

    base = _tied_tiny_dir(tmp_path / "tied")
    policy, tok = build_policy(base)
    with torch.no_grad():
        policy.model.embed_tokens.weight.add_(0.05)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    named = unique_tensors(policy.state_dict())  # as the trainer streams it: embed_tokens only
    assert "lm_head.weight" not in named
    out = tmp_path / "hf"
    save_hf_from_stream(TensorStream.from_mapping(named), base, str(out))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(loaded.lm_head.weight, policy.model.embed_tokens.weight)
    assert torch.equal(_logits(loaded, tok), _logits(policy, tok))
    # Listed twice, the tied tensor is refused by name, before the stream is touched.
    stream = TensorStream.from_mapping(policy.state_dict())
    with pytest.raises(ValueError, match=r"1 are not the model's \(lm_head.weight\)"):
        save_hf_from_stream(stream, base, str(tmp_path / "o2"))
    assert stream.consumed == 0 and not os.path.exists(tmp_path / "o2")


def test_save_hf_from_stream_failure_leaves_nothing_and_does_not_drain(tmp_path):
    from lightning_fasync.export.hf import save_hf_from_stream
    from lightning_fasync.weights.tensor_stream import TensorStream

    policy, _ = _perturbed()
    items = list(policy.state_dict().items())

    def produce(i):
        if i == len(items) // 2:  # after some shards are written
            raise RuntimeError("gather failed")
        return items[i][1]

    stream = TensorStream(TensorStream.from_mapping(dict(items)).specs, produce)
    with pytest.raises(RuntimeError, match="gather failed"):
        save_hf_from_stream(stream, "tiny", str(tmp_path / "hf"), max_shard_bytes=100_000)
    assert stream.consumed == len(items) // 2 + 1  # the rest is the caller's to drain
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="nothing was taken"):
        save_hf_from_stream(stream, "tiny", str(tmp_path / "hf"))


# ------------------------------------------------------------------------------ sharded checkpoints


def _sharded_checkpoint(path, policy, model="tiny"):
    """A directory laid out as ModelParallelStrategy writes it (DCP files of {"state_dict",
    "optimizer_0"}, plus meta.pt), from one process; the Lightning-written case is the slow test."""
    import torch.distributed.checkpoint as dcp

    state = {"policy." + k: v for k, v in policy.state_dict().items()}
    optim = {"state": {k: {"exp_avg": torch.randn_like(v), "step": torch.tensor(3.0)} for k, v in state.items()},
             "param_groups": [{"lr": 0.1, "params": list(state)}]}
    single = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}  # torch >= 2.7
    dcp.save({"state_dict": state, "optimizer_0": optim}, checkpoint_id=str(path), **single)
    torch.save({"epoch": 0, "global_step": 3, "hyper_parameters": {"model": model}}, os.path.join(path, "meta.pt"))


def test_export_reads_only_the_policy_from_a_sharded_checkpoint_directory(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    policy, tok = _perturbed()
    ckpts = tmp_path / "checkpoints"
    _sharded_checkpoint(ckpts / "step-000003.ckpt", policy)
    os.symlink("step-000003.ckpt", ckpts / "last.ckpt")
    read = []
    real_read = FileSystemReader.read_data

    def read_data(self, plan, planner):
        read.extend(item.dest_index.fqn for item in plan.items)
        return real_read(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", read_data)
    out = tmp_path / "hf"
    assert main(["export", "--ckpt_path", str(ckpts / "last.ckpt"), "--out", str(out)]) == 0
    assert read and all(k.startswith("state_dict.policy.") for k in read), read  # no optimizer state
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(_logits(loaded, tok), _logits(policy, tok))

    # The same refusals as for a file, before any weight is read.
    read.clear()
    with pytest.raises(ValueError, match=r"do not fit 'qwen3-30m-shape': .* have another shape"):
        from lightning_fasync.export.hf import export_checkpoint

        export_checkpoint(str(ckpts / "last.ckpt"), str(tmp_path / "o2"), model="qwen3-30m-shape")
    assert read == []


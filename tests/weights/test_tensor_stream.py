"""Weight sync from a :class:`TensorStream` (a sharded trainer's full tensors, gathered one at a
time): its buckets follow the mapping's rule and hold one tensor at a time, a stream is taken once,
a failed ``take`` is named. Against real engines (each path loads from a stream what it loads from
the mapping, one bucket and one tensor held; a stream failing mid-push, then a fresh one; an engine
lost mid-push) the tests are in ``tests/weights/test_sync.py``, beside the paths' own, using :class:`Tracked`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.weights.tensor_stream import TensorSpec, TensorStream
from lightning_fasync.weights.sync import WeightSyncError, _Streamed, make_weight_sync
from lightning_fasync.weights.wire import flatten_into, plan_buckets
from tests.helpers.weights import Tracked


def test_a_streams_buckets_follow_the_mapping_rule_and_hold_one_tensor_at_a_time():
    named = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(4),
             "big": torch.randn(64), "d": torch.randn(2, 2).to(torch.float16), "e": torch.randn(3)}
    tracked = Tracked(named)
    streamed = _Streamed(tracked.stream, 100)
    expected = plan_buckets(named, 100)  # one rule: the specs plan the buckets the tensors would
    assert [[s.name for s in b] for b in streamed.buckets] == [[n for n, _ in b] for b in expected]
    for i, bucket in enumerate(expected):
        filled = streamed.fill(i, lambda nbytes, device: torch.empty(nbytes, dtype=torch.uint8, device=device))
        flat = torch.empty(filled.flat.numel(), dtype=torch.uint8)
        assert filled.metadata == flatten_into(bucket, flat) and torch.equal(filled.flat, flat)
    # Each tensor was dropped once copied into its bucket, before the next was taken.
    assert tracked.held == [(0, 0)] * len(named)
    with pytest.raises(RuntimeError, match="taken once, in order"):
        streamed.fill(0, lambda nbytes, device: torch.empty(nbytes, dtype=torch.uint8))


def test_a_stream_is_pushed_fresh_and_a_failed_take_names_the_tensor():
    state = {"a": torch.randn(4), "b": torch.randn(4)}
    sync = make_weight_sync("tensor", SGLangClient(["http://127.0.0.1:9"]))  # refused before any call
    stream = TensorStream.from_mapping(state)
    stream.take()
    with pytest.raises(ValueError, match="already consumed"):
        asyncio.run(sync.push(stream, 1))
    with pytest.raises(ValueError, match="no tensors"):
        asyncio.run(sync.push(TensorStream([], lambda i: None), 1))
    failing = _Streamed(Tracked(state, fail_at=1).stream, 100)
    failing.where = "step 3"
    with pytest.raises(WeightSyncError, match=r"step 3 failed taking b \(tensor 2 of 2\).*the gather failed"):
        failing.fill(0, lambda nbytes, device: torch.empty(nbytes, dtype=torch.uint8))
    assert failing.stream.consumed == 2  # the rest is the caller's to drain


def test_a_modules_stream_lists_a_tied_tensor_once_checks_specs_and_is_taken_once():
    from lightning_fasync.weights.shard_gather import full_tensor_stream, is_sharded

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as tie_word_embeddings makes it
    stream = full_tensor_stream(model)
    assert not is_sharded(model)
    assert [s.name for s in stream.specs] == ["0.weight"] and stream.nbytes == 10 * 4 * 4
    assert [(n, t.data_ptr()) for n, t in stream] == [("0.weight", model[0].weight.data_ptr())]
    with pytest.raises(RuntimeError, match="iterated once"):
        list(stream)
    bad = TensorStream([TensorSpec("w", (2, 2), torch.float32)], lambda i: torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"produced w as \(3,\) torch.float32; its spec says \(2, 2\)"):
        bad.drain()
    with pytest.raises(ValueError, match="unique"):
        TensorStream([TensorSpec("w", (1,), torch.float32)] * 2, lambda i: torch.zeros(1))

"""In-flight weight updates on the embedded engine (``rollout.weight_update_mode: inflight``).

A request frozen mid-decode (SGLang's ``/pause_generation`` modes: ``in_place`` keeps its KV cache,
``retract`` drops it and prefills again on resume) takes new weights and goes on decoding. Its
reported log-probs are checked against independent HF forward passes:

- the tokens before the swap against the old weights (one plain forward);
- after the swap with ``in_place``: against the new weights reading the old weights' keys and values
  for the positions computed before the swap (HF's own KV cache, filled by the old model, then
  continued by the new one);
- after the swap with ``retract``: against the new weights over the whole sequence (recomputed).

The engine's counters say nothing was aborted, and what was prefilled: only the prompt with
``in_place``; prompt + tokens so far once more with ``retract``.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from lightning_fasync.engine.engine import Engine
from lightning_fasync.policy import build_policy
from tests.helpers.engine import submit

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def models():
    old, tok = build_policy("tiny")
    new = copy.deepcopy(old)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # every weight moves: attention's keys and values too, not just the head
        for p in new.parameters():
            p.add_(0.2 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return old.eval(), new.eval(), tok


def _logprobs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [lp[i, t].item() for i, t in enumerate(tokens)]


def _reference(old, new, prompt: list[int], out: list[int], k: int, keep: bool) -> list[float]:
    """Log-probs of ``out`` as the engine should report them when the swap came after ``k`` output
    tokens: token i < k from the old weights; from token k on, the new weights, over the old
    weights' cache of the positions before the swap (``keep``) or over their own (recompute)."""
    seq = torch.tensor([prompt + out])
    p = len(prompt)
    with torch.no_grad():
        before = _logprobs(old(seq).logits[0, p - 1 : p - 1 + k], out[:k])
        if not keep:
            return before + _logprobs(new(seq).logits[0, p - 1 + k : p - 1 + len(out)], out[k:])
        # Before the swap the engine had run positions < p + k - 1 (the k-th token is fed at the
        # next decode step, the first under the new weights).
        cut = p + k - 1
        cache = old(seq[:, :cut], use_cache=True).past_key_values
        after = new(seq[:, cut : p - 1 + len(out)], past_key_values=cache, use_cache=True).logits[0]
    return before + _logprobs(after, out[k:])


class HoldAt:
    """An ``on_token`` that holds the engine thread at a request's ``n``-th token until
    :meth:`release`, then sleeps ``slow`` seconds per token: what the test does next lands
    mid-decode however fast the model or however loaded the machine (a tiny model can decode a
    whole answer between two polls of the test's thread)."""

    def __init__(self, n: int, slow: float = 0.0) -> None:
        self.n, self.slow = n, slow
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, r) -> None:
        if len(r.output_ids) == self.n:
            self.reached.set()
            self.go.wait(30)
        elif len(r.output_ids) > self.n and self.slow:
            time.sleep(self.slow)

    def wait_then_release(self) -> None:
        assert self.reached.wait(30), f"the engine produced no token {self.n} within 30 s"
        self.go.set()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_frozen_request_continues_under_the_new_weights(models, mode):
    old, new, tok = models
    engine = Engine(copy.deepcopy(old), max_running_requests=4)
    try:
        prompt = tok("in flight", add_special_tokens=False)["input_ids"]
        # Held at the 5th token until the pause is on its way, then decoding on slowly.
        hold = HoldAt(5, slow=0.02)
        req, done = submit(engine, "f", prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0,
                           on_token=hold)
        hold.wait_then_release()
        assert engine.pause(mode) == (1 if mode == "retract" else 0)
        k = len(req.output_ids)
        assert 5 <= k < NEW_TOKENS and not done.is_set()
        engine.update_weights({n: t.detach().clone() for n, t in new.state_dict().items()}, weight_version="1")
        assert len(req.output_ids) == k  # frozen through the swap
        engine.resume()
        assert done.wait(60) and req.finish_reason["type"] == "length"
        out = list(req.output_ids)
        assert req.version_spans() == [{"version": "default", "start": 0, "end": k},
                                       {"version": "1", "start": k, "end": NEW_TOKENS}]
        got = list(req.output_logprobs)
        want = _reference(old, new, prompt, out, k, keep=mode == "in_place")
        assert got == pytest.approx(want, abs=1e-4)
        # And it is not the other mode's reference: the test tells keep from recompute.
        other = _reference(old, new, prompt, out, k, keep=mode != "in_place")
        assert max(abs(a - b) for a, b in zip(got[k:], other[k:])) > 1e-2
        assert engine.aborted_requests == 0
        assert engine.prefill_tokens == len(prompt) + (len(prompt) + k if mode == "retract" else 0)
        assert req.retractions == (1 if mode == "retract" else 0)
    finally:
        engine.stop()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("keep", [True, False])
def test_an_aborted_request_resumed_after_an_update_goes_on_from_its_kept_cache(models, keep):
    """``keep_aborted_kv`` (``rollout.resume_kv: keep``): the request aborted after its 5th token
    leaves its cache; resumed after the swap (prompt + tokens so far, as the pipeline resumes it) it
    goes on from that cache with no prefill, so its log-probs are the new weights' over the old
    weights' keys and values (the frozen request's reference above), and ``cached_tokens`` counts
    what it did not prefill. Without it the resumed request is prefilled again under the new weights."""
    old, new, tok = models
    engine = Engine(copy.deepcopy(old), max_running_requests=4, keep_aborted_kv=keep)
    try:
        prompt = tok("in flight", add_special_tokens=False)["input_ids"]
        hold = HoldAt(5)
        req, done = submit(engine, "a", prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0,
                           on_token=hold)
        hold.wait_then_release()
        assert engine.abort("a") == 1 and done.wait(30) and req.finish_reason["type"] == "abort"
        k = len(req.output_ids)
        assert 5 <= k < NEW_TOKENS and engine.kept_kv == (1 if keep else 0)
        engine.update_weights({n: t.detach().clone() for n, t in new.state_dict().items()}, weight_version="1")
        resumed, done = submit(engine, "a-resumed", prompt + req.output_ids, max_new_tokens=NEW_TOKENS - k,
                               ignore_eos=True, temperature=1.0)
        assert done.wait(60) and resumed.finish_reason["type"] == "length"
        out = list(req.output_ids) + list(resumed.output_ids)
        got = list(req.output_logprobs) + list(resumed.output_logprobs)
        assert got == pytest.approx(_reference(old, new, prompt, out, k, keep=keep), abs=1e-4)
        other = _reference(old, new, prompt, out, k, keep=not keep)
        assert max(abs(a - b) for a, b in zip(got[k:], other[k:])) > 1e-2
        assert resumed.cached_tokens == (len(prompt) + k - 1 if keep else 0)
        assert engine.prefill_tokens == len(prompt) + (0 if keep else len(prompt) + k)
        assert (engine.kept_kv_hits, engine.kept_kv) == ((1, 0) if keep else (0, 0))
    finally:
        engine.stop()


def test_kept_caches_give_way_to_requests_that_need_the_memory_and_go_with_a_flush(models):
    """A kept cache holds its slot and blocks until a request needs them (here the engine's only
    other slot), a flush, or a release of the KV cache; a request whose prompt does not continue it
    is prefilled as usual."""
    old, _, tok = models
    engine = Engine(copy.deepcopy(old), max_running_requests=2, keep_aborted_kv=True)
    try:
        def abort_after(rid, prompt):
            hold = HoldAt(3)
            req, done = submit(engine, rid, prompt, max_new_tokens=100, ignore_eos=True, on_token=hold)
            hold.wait_then_release()
            assert engine.abort(rid) == 1 and done.wait(30)
            return req

        first = abort_after("x", [5, 6, 7])
        second = abort_after("y", [8, 9, 10, 11])
        assert engine.kept_kv == 2  # both slots held by kept caches
        # Two requests that continue neither: each takes a kept cache's slot, oldest first.
        runs = [submit(engine, f"n{i}", [12 + i, 13], max_new_tokens=4, ignore_eos=True) for i in range(2)]
        assert all(done.wait(60) for _, done in runs) and engine.kept_kv == 0
        assert engine.kept_kv_hits == 0 and all(r.cached_tokens == 0 for r, _ in runs)
        # A flush drops a kept cache, and so does releasing the KV cache.
        abort_after("z", [5, 6, 7])
        assert engine.kept_kv == 1 and engine.flush_cache()[0] and engine.kept_kv == 0
        abort_after("w", [5, 6, 7])
        assert engine.kept_kv == 1
        engine.pause("abort")
        engine.release_memory_occupation(["kv_cache"])
        assert engine.kept_kv == 0
        engine.resume_memory_occupation(["kv_cache"])
        engine.resume()
        # What was aborted and never resumed is prefilled again when it comes back now.
        again, done = submit(engine, "x-again", first.input_ids + first.output_ids, max_new_tokens=2, ignore_eos=True)
        assert done.wait(60) and again.cached_tokens == 0
        assert second.finish_reason["type"] == "abort"
    finally:
        engine.stop()

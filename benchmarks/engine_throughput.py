"""Embedded engine throughput against Hugging Face ``generate``, measured side by side in one run.

Both generate the same number of tokens (``--requests`` prompts x ``--max-new-tokens``, EOS ignored,
sampling at temperature 1.0) from the same model on the same thread count and core. HF ``generate``
gets the whole batch at once (left-padded), its best case; the engine gets the requests
concurrently over HTTP (default; the client runs on another core when there is one, as the
trainer's producer would) or in-process (``--in-process``). The two are measured alternately
``--repeats`` times and the best run of each is compared, so a noisy neighbour on a shared machine
hits both sides alike.

    python benchmarks/engine_throughput.py                      # tiny preset, 1 thread, CPU
    python benchmarks/engine_throughput.py --device cuda --preset qwen3-0.6b-shape   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
from typing import Callable

import torch


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer(f"Question {i}: what is {i} + {i * 7 % 13}? Answer:", add_special_tokens=False)["input_ids"]
            for i in range(n)]


def hf_runner(model, tokenizer, batch: list[list[int]], max_new: int, device: str) -> Callable[[], tuple[int, float]]:
    width = max(len(p) for p in batch)
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                  min_new_tokens=max_new, pad_token_id=pad)
    with torch.inference_mode():  # warm-up
        model.generate(ids[:2], **{**kwargs, "attention_mask": mask[:2], "max_new_tokens": 4, "min_new_tokens": 4})

    def run() -> tuple[int, float]:
        with torch.inference_mode():
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids, **kwargs)
            _sync(device)
            return (out.shape[1] - width) * len(batch), time.perf_counter() - t0

    return run


def hf_one_at_a_time(model, tokenizer, batch: list[list[int]], max_new: int, device: str) -> tuple[int, float]:
    """HF ``generate`` serving requests one by one, as a simple rollout worker without batching would."""
    pad = tokenizer.pad_token_id or 0
    tokens, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for p in batch:
            out = model.generate(torch.tensor([p], device=device), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad)
            tokens += out.shape[1] - len(p)
    _sync(device)
    return tokens, time.perf_counter() - t0


def in_process_runner(model, batch: list[list[int]], args) -> tuple[Callable[[], tuple[int, float]], Callable[[], None]]:
    from lightning_fasync.rollout.engine import Engine, EngineRequest

    engine = Engine(model, max_running_requests=args.max_running_requests, context_length=args.context_length)
    engine.generate(batch[0], max_new_tokens=4)  # warm-up

    def run() -> tuple[int, float]:
        done, lock, finished = threading.Event(), threading.Lock(), []

        def on_finish(req):
            with lock:
                finished.append(req)
                if len(finished) == len(batch):
                    done.set()

        t0 = time.perf_counter()
        for i, p in enumerate(batch):
            engine.submit(EngineRequest(rid=f"b{i}", input_ids=p, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                        on_finish=on_finish))
        if not done.wait(3600):
            raise TimeoutError("The engine did not finish the benchmark batch within an hour.")
        return sum(len(r.output_ids) for r in finished), time.perf_counter() - t0

    return run, engine.stop


def http_runner(batch: list[list[int]], args, cores: list[int]) -> tuple[Callable[[], tuple[int, float]], Callable[[], None]]:
    from lightning_fasync.pipeline.engine import GenerateRequest, SamplingParams
    from lightning_fasync.rollout.client import SGLangClient
    from lightning_fasync.rollout.launch import launch_server

    server = launch_server(args.preset, threads=args.threads, max_running_requests=args.max_running_requests,
                           cpu_cores=cores if args.device == "cpu" else None, context_length=args.context_length,
                           extra_args=["--device", args.device, "--dtype", args.dtype], timeout=600)
    others = set(range(os.cpu_count() or 1)) - set(cores)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)

    async def one_batch() -> tuple[int, float]:
        client = SGLangClient([server.url])
        try:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(client.generate(GenerateRequest(f"b{i}", p, sp)) for i, p in enumerate(batch)))
            return sum(len(r.output_ids) for r in results), time.perf_counter() - t0
        finally:
            await client.close()

    def run() -> tuple[int, float]:
        # The client is the load generator (the trainer's producer in real use), not part of the
        # engine: when there is another core it runs there; HF runs on the engine's core.
        if others and args.device == "cpu":
            os.sched_setaffinity(0, others)
        try:
            return asyncio.run(one_batch())
        finally:
            if args.device == "cpu":
                os.sched_setaffinity(0, set(cores))

    return run, server.stop


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="Alternating runs of each; the best of each is compared.")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default).")
    p.add_argument("--context-length", type=int, default=None,
                   help="Engine tokens per request (sizes the KV cache); default: the model's, 1024 on CUDA.")
    p.add_argument("--in-process", action="store_true", help="Drive the engine in-process instead of over HTTP.")
    p.add_argument("--sequential-sample", type=int, default=4,
                   help="Requests timed for the one-at-a-time HF baseline (a rate, so a few suffice); 0 skips it.")
    args = p.parse_args()

    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    if args.device == "cpu":
        os.sched_setaffinity(0, set(cores))  # HF runs on the same cores the engine server gets
    torch.set_num_threads(args.threads)
    if args.context_length is None and args.device.startswith("cuda"):
        args.context_length = 1024  # Qwen3's 40k context would make a 64-slot KV cache needlessly large
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    from lightning_fasync.policy import build_policy

    model, tokenizer = build_policy(args.preset, dtype=getattr(torch, args.dtype))
    model.to(args.device)
    batch = make_prompts(tokenizer, args.requests)
    print(f"preset={args.preset} device={args.device} dtype={args.dtype} threads={args.threads} cores={cores} "
          f"requests={args.requests} max_new_tokens={args.max_new_tokens} repeats={args.repeats}")

    hf = hf_runner(model, tokenizer, batch, args.max_new_tokens, args.device)
    if args.in_process:
        mode = "in-process"
        engine, stop = in_process_runner(model, batch, args)
    else:
        mode = "HTTP server"
        engine, stop = http_runner(batch, args, cores)
    hf_runs, eng_runs = [], []
    try:
        engine()  # warm-up batch: first-touch of the KV cache, allocator growth
        for _ in range(args.repeats):
            hf_runs.append(hf())
            eng_runs.append(engine())
    finally:
        stop()
    seq_tps = None
    if args.sequential_sample:
        n, secs = hf_one_at_a_time(model, tokenizer, batch[: args.sequential_sample], args.max_new_tokens, args.device)
        seq_tps = n / secs
    hf_tps = [n / s for n, s in hf_runs]
    eng_tps = [n / s for n, s in eng_runs]
    hf_tokens, eng_tokens = hf_runs[0][0], eng_runs[0][0]
    print(f"HF generate (batched):       {hf_tokens} tokens/run, best {max(hf_tps):,.0f} tokens/s, "
          f"median {statistics.median(hf_tps):,.0f} tokens/s")
    print(f"embedded engine ({mode}): {eng_tokens} tokens/run, best {max(eng_tps):,.0f} tokens/s, "
          f"median {statistics.median(eng_tps):,.0f} tokens/s")
    print(f"ratio engine / HF generate (batched): best {max(eng_tps) / max(hf_tps):.2f}x, "
          f"median {statistics.median(eng_tps) / statistics.median(hf_tps):.2f}x")
    if seq_tps is not None:
        print(f"HF generate, one request at a time ({args.sequential_sample} timed): {seq_tps:,.0f} tokens/s; "
              f"ratio engine (best) / it: {max(eng_tps) / seq_tps:.1f}x")


if __name__ == "__main__":
    main()

"""Embedded engine throughput against Hugging Face ``generate``, measured side by side in one run.

Two scenarios, each ``--requests`` concurrent prompts from the same model on the same thread count
and core, EOS ignored, sampling at temperature 1.0:

* **uniform**: every request asks for ``--max-new-tokens`` tokens. HF ``generate`` gets the whole
  batch at once (left-padded) and wastes nothing: its best case.
* **varied**: response lengths are long-tailed, as RL rollouts are: each request's
  ``max_new_tokens`` is drawn from a geometric distribution with mean ``--mean-new-tokens``, capped
  at ``--max-new-tokens`` (seeded, so both sides and every run see the same lengths). A static HF
  batch must generate to the longest request; only the tokens each request asked for are counted
  (that is what a static batch delivers). The engine finishes each request at its own length.

The engine gets the requests concurrently over HTTP (default; the client runs on another core when
there is one, as the trainer's producer would) or in-process (``--in-process``). HF and engine runs
of both scenarios alternate ``--repeats`` times, so a noisy neighbour on a shared machine hits both
sides alike; best and median of each are reported.

    python benchmarks/engine_throughput.py                      # tiny preset, 1 thread, CPU
    python benchmarks/engine_throughput.py --preset tiny,qwen3-30m-shape   # both CPU presets in turn
    python benchmarks/engine_throughput.py --device cuda --preset qwen3-0.6b-shape   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import threading
import time
from typing import Callable

import torch


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer(f"Question {i}: what is {i} + {i * 7 % 13}? Answer:", add_special_tokens=False)["input_ids"]
            for i in range(n)]


def response_lengths(n: int, mean: float, cap: int, seed: int = 0) -> list[int]:
    """Long-tailed per-request response lengths: geometric on 1, 2, ... with the given mean, capped."""
    rng = random.Random(seed)
    p = 1.0 / mean
    lengths = []
    for _ in range(n):
        k = 1
        while rng.random() >= p and k < cap:
            k += 1
        lengths.append(k)
    return lengths


def hf_runner(model, tokenizer, batch: list[list[int]], lengths: list[int],
              device: str) -> Callable[[], tuple[int, float]]:
    """One static, left-padded batch generated to the longest request; counts the tokens each asked for."""
    width = max(len(p) for p in batch)
    longest = max(lengths)
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=longest,
                  min_new_tokens=longest, pad_token_id=pad)
    with torch.inference_mode():  # warm-up
        model.generate(ids[:2], **{**kwargs, "attention_mask": mask[:2], "max_new_tokens": 4, "min_new_tokens": 4})

    def run() -> tuple[int, float]:
        with torch.inference_mode():
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids, **kwargs)
            _sync(device)
            elapsed = time.perf_counter() - t0
        generated = out.shape[1] - width
        assert generated == longest, (generated, longest)
        return sum(min(n, generated) for n in lengths), elapsed

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


def in_process_runner(model, args) -> tuple[Callable[..., tuple[int, float]], Callable[[], None]]:
    from lightning_fasync.engine.engine import Engine, EngineRequest

    engine = Engine(model, max_running_requests=args.max_running_requests, context_length=args.context_length,
                    max_total_tokens=args.max_total_tokens)

    def run(batch: list[list[int]], lengths: list[int]) -> tuple[int, float]:
        done, lock, finished = threading.Event(), threading.Lock(), []

        def on_finish(req):
            with lock:
                finished.append(req)
                if len(finished) == len(batch):
                    done.set()

        t0 = time.perf_counter()
        for i, (p, n) in enumerate(zip(batch, lengths)):
            engine.submit(EngineRequest(rid=f"b{i}", input_ids=p, max_new_tokens=n, ignore_eos=True,
                                        on_finish=on_finish))
        if not done.wait(3600):
            raise TimeoutError("The engine did not finish the benchmark batch within an hour.")
        return sum(len(r.output_ids) for r in finished), time.perf_counter() - t0

    return run, engine.stop


def http_runner(args, cores: list[int]) -> tuple[Callable[..., tuple[int, float]], Callable[[], None]]:
    from lightning_fasync.pipeline.engine_client import GenerateRequest, SamplingParams
    from lightning_fasync.fleet.client import SGLangClient
    from lightning_fasync.fleet.launch import launch_server

    server = launch_server(args.preset, threads=args.threads, max_running_requests=args.max_running_requests,
                           cpu_cores=cores if args.device == "cpu" else None, context_length=args.context_length,
                           extra_args=["--device", args.device, "--dtype", args.dtype]
                           + (["--max-total-tokens", str(args.max_total_tokens)] if args.max_total_tokens else []),
                           timeout=600)
    others = set(range(os.cpu_count() or 1)) - set(cores)
    # One long-lived client on one event loop, as the trainer's producer holds it: its connection
    # pool stays warm between batches (a fresh client per batch would time 64 TCP connects too).
    loop = asyncio.new_event_loop()
    client = SGLangClient([server.url])  # its aiohttp session is opened lazily, inside `loop`

    async def one_batch(batch: list[list[int]], lengths: list[int], tag: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            client.generate(GenerateRequest(f"{tag}-{i}", p, SamplingParams(max_new_tokens=n, ignore_eos=True)))
            for i, (p, n) in enumerate(zip(batch, lengths))))
        return sum(len(r.output_ids) for r in results), time.perf_counter() - t0

    batches = iter(range(1 << 30))

    def run(batch: list[list[int]], lengths: list[int]) -> tuple[int, float]:
        # The client is the load generator (the trainer's producer in real use), not part of the
        # engine: when there is another core it runs there; HF runs on the engine's core.
        if others and args.device == "cpu":
            os.sched_setaffinity(0, others)
        try:
            return loop.run_until_complete(one_batch(batch, lengths, f"b{next(batches)}"))
        finally:
            if args.device == "cpu":
                os.sched_setaffinity(0, set(cores))

    def stop() -> None:
        try:
            loop.run_until_complete(client.close())
            loop.close()
        finally:
            server.stop()

    return run, stop


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny",
                   help="Comma-separated policy presets, measured one after the other (tiny, qwen3-30m-shape, "
                        "qwen3-0.6b-shape) or a local model directory.")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="Tokens per request in the uniform scenario; the cap of the varied scenario.")
    p.add_argument("--mean-new-tokens", type=float, default=24.0,
                   help="Mean of the varied scenario's geometric response lengths (before the cap).")
    p.add_argument("--scenarios", default="uniform,varied", help="Comma-separated: uniform, varied.")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3,
                   help="Alternating runs of each side and scenario; best and median of each are reported.")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default).")
    p.add_argument("--context-length", type=int, default=None,
                   help="Engine tokens per request; default: the model's, at most 1024 on CUDA and 512 on CPU.")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="The engine's KV pool in tokens (--max-total-tokens); default: the engine's, from its budget.")
    p.add_argument("--in-process", action="store_true", help="Drive the engine in-process instead of over HTTP.")
    p.add_argument("--sequential-sample", type=int, default=4,
                   help="Requests timed for the one-at-a-time HF baseline (a rate, so a few suffice); 0 skips it.")
    args = p.parse_args()
    presets = [name.strip() for name in args.preset.split(",") if name.strip()]
    for i, preset in enumerate(presets):
        if i:
            print()
        measure(argparse.Namespace(**{**vars(args), "preset": preset}))


def measure(args: argparse.Namespace) -> None:
    """Both scenarios for one preset: HF and engine runs alternating, then the table."""
    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    if args.device == "cpu":
        os.sched_setaffinity(0, set(cores))  # HF runs on the same cores the engine server gets
    torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    from lightning_fasync.policy import build_policy

    model, tokenizer = build_policy(args.preset, dtype=getattr(torch, args.dtype))
    if args.context_length is None:
        # Prompts of ~30 tokens + --max-new-tokens: a model's long context would only size the pool.
        cap = 1024 if args.device.startswith("cuda") else 512
        args.context_length = max(min(model.config.max_position_embeddings, cap), args.max_new_tokens + 64)
    model.to(args.device)
    batch = make_prompts(tokenizer, args.requests)
    params = sum(p.numel() for p in model.parameters())
    print(f"preset={args.preset} ({params / 1e6:.1f}M parameters) device={args.device} dtype={args.dtype} "
          f"threads={args.threads} cores={cores} requests={args.requests} max_new_tokens={args.max_new_tokens} "
          f"context_length={args.context_length} repeats={args.repeats}")

    scenarios = {}
    for name in [n.strip() for n in args.scenarios.split(",") if n.strip()]:
        if name == "uniform":
            lengths = [args.max_new_tokens] * args.requests
        elif name == "varied":
            lengths = response_lengths(args.requests, args.mean_new_tokens, args.max_new_tokens)
        else:
            raise SystemExit(f"Unknown scenario {name!r}; use uniform and/or varied.")
        scenarios[name] = (lengths, hf_runner(model, tokenizer, batch, lengths, args.device))
    for name, (lengths, _) in scenarios.items():
        print(f"{name}: response lengths mean {statistics.mean(lengths):.1f}, median {statistics.median(lengths):g}, "
              f"max {max(lengths)}, total {sum(lengths)} tokens")
    if args.in_process:
        mode = "in-process"
        engine, stop = in_process_runner(model, args)
    else:
        mode = "HTTP server"
        engine, stop = http_runner(args, cores)
    hf_runs: dict[str, list] = {name: [] for name in scenarios}
    eng_runs: dict[str, list] = {name: [] for name in scenarios}
    try:
        for lengths, _ in scenarios.values():
            engine(batch, lengths)  # warm-up batch: first-touch of the KV cache, allocator growth
        for _ in range(args.repeats):
            for name, (lengths, hf) in scenarios.items():
                hf_runs[name].append(hf())
                eng_runs[name].append(engine(batch, lengths))
    finally:
        stop()
    seq_tps = None
    if args.sequential_sample:
        n, secs = hf_one_at_a_time(model, tokenizer, batch[: args.sequential_sample], args.max_new_tokens, args.device)
        seq_tps = n / secs
    best_engine = 0.0
    for name in scenarios:
        hf_tps = [n / s for n, s in hf_runs[name]]
        eng_tps = [n / s for n, s in eng_runs[name]]
        if name == "uniform":
            best_engine = max(eng_tps)
        hf_tokens, eng_tokens = hf_runs[name][0][0], eng_runs[name][0][0]
        print(f"[{name}] HF generate (one static batch): {hf_tokens} tokens/run, best {max(hf_tps):,.0f} tokens/s, "
              f"median {statistics.median(hf_tps):,.0f} tokens/s")
        print(f"[{name}] embedded engine ({mode}): {eng_tokens} tokens/run, best {max(eng_tps):,.0f} tokens/s, "
              f"median {statistics.median(eng_tps):,.0f} tokens/s")
        print(f"[{name}] ratio engine / HF generate: best {max(eng_tps) / max(hf_tps):.2f}x, "
              f"median {statistics.median(eng_tps) / statistics.median(hf_tps):.2f}x")
    if seq_tps is not None:
        line = f"HF generate, one request at a time ({args.sequential_sample} timed): {seq_tps:,.0f} tokens/s"
        if best_engine:
            line += f"; ratio engine (uniform, best) / it: {best_engine / seq_tps:.1f}x"
        print(line)


if __name__ == "__main__":
    main()

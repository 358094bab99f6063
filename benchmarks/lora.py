"""LoRA (``model.lora``) against full fine-tuning: the weight push and the trainer, measured in one run
(docs/lora.md, "Measured").

``push``: two embedded engine processes (``--model``, default ``qwen3-30m-shape``, one thread each;
one receives the merged pushes, the other the adapter pushes) and, in this process, a LoRA policy (``--r``, ``--alpha``, every linear layer of the decoder; B given random
values so the merge is not a no-op). Alternately, ``--rounds`` times after one warm-up each: the
``merged`` push (``engine_state_dict()`` computes base + B·A·scale, then ``rollout.weight_sync:
tensor`` sends it, pause to continue) and the ``adapter`` push (``engine_state_dict()`` gives the
adapter, ``rollout.weight_sync: adapter`` writes it in peft's format into the engine's LoRA directory
and the engine unloads the previous adapter, then loads and merges this one, as at every step of a
run). Reported per kind: bytes sent (the tensors' bytes; the adapter's with its
``adapter_config.json``), seconds from ``engine_state_dict()`` to the engine's answer (median and
range), and the ratio of the medians.

``train``: the trainer's cost, full fine-tuning against LoRA, each round a fresh process per mode
(alternating full, lora, full, ...; ``--rounds`` each): ``RLPolicyModule`` built, its own optimizer
(``configure_optimizers``: AdamW over the trainable parameters), then ``--steps`` training steps
(forward, token NLL, backward, optimizer step) on one fixed batch (``--batch`` sequences of
``--seq`` tokens) at ``--threads`` torch threads, after two warm-up steps. Reported: the step time
(median of the process's steps; then median and range over rounds), the process's peak resident
set (``ru_maxrss``), and the bytes of parameters, gradients and optimizer state (counted from the
tensors after the last step). The step is the policy's forward and backward, the bulk of a training
call; the loss machinery around it (advantages, clipping) is the same in both modes.

    python benchmarks/lora.py                       # both sections, qwen3-30m-shape, 3 rounds
    python benchmarks/lora.py --rounds 5 --r 8

Writes ``lora.md`` and ``results.json`` (with the machine record: nproc, CPU model, load average
before and after, date, commit) to ``--out`` (default ``benchmarks/results/lora``); warns when the
load average before the run exceeds 0.5 per core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._machine import REPO, check_load, header, record  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def lora_module(model: str, r: int, alpha: float, sync: str, seed: int = 0) -> Any:
    import torch

    from lightning_fasync.lightning.module import RLPolicyModule

    torch.manual_seed(seed)
    module = RLPolicyModule(model, lora={"r": r, "alpha": alpha, "target_modules": TARGETS, "sync": sync})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return module


def nbytes(tensors: Any) -> int:
    from lightning_fasync.weights.sync import unique_tensors

    return sum(t.numel() * t.element_size() for t in unique_tensors(dict(tensors)).values())


# ------------------------------------------------------------------------------ push


async def push_rounds(urls: dict[str, str], merged_module: Any, adapter_module: Any, rounds: int,
                      work_dir: str) -> dict[str, Any]:
    from lightning_fasync.fleet.client import SGLangClient
    from lightning_fasync.weights.sync import make_weight_sync

    syncs = {"merged": make_weight_sync("tensor", SGLangClient([urls["merged"]], admin_timeout_s=600), timeout_s=600),
             "adapter": make_weight_sync("adapter", SGLangClient([urls["adapter"]], admin_timeout_s=600), timeout_s=600,
                                         work_dir=work_dir)}
    modules = {"merged": merged_module, "adapter": adapter_module}
    times: dict[str, list[float]] = {"merged": [], "adapter": []}
    sizes: dict[str, int] = {}
    version = 0
    try:
        for i in range(rounds + 1):  # round 0 is the warm-up
            for kind in ("merged", "adapter"):
                version += 1
                t0 = time.perf_counter()
                weights = modules[kind].engine_state_dict()
                await syncs[kind].push(weights, version)
                elapsed = time.perf_counter() - t0
                if kind == "adapter":
                    sizes[kind] = nbytes(weights) + len(json.dumps(weights.config).encode())
                else:
                    sizes[kind] = nbytes(weights)
                del weights
                if i:
                    times[kind].append(elapsed)
                print(f"push {kind} round {i}: {elapsed:.3f} s", file=sys.stderr, flush=True)
    finally:
        for sync in syncs.values():
            await sync.close()
    out = {kind: {"bytes": sizes[kind], "seconds": summary(times[kind])} for kind in times}
    out["ratio_seconds"] = out["merged"]["seconds"]["median"] / out["adapter"]["seconds"]["median"]
    out["ratio_bytes"] = sizes["merged"] / sizes["adapter"]
    return out


def bench_push(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch

    from lightning_fasync.fleet.launch import launch_server

    torch.set_num_threads(args.threads)
    merged_module = lora_module(args.model, args.r, args.alpha, "merged")
    adapter_module = lora_module(args.model, args.r, args.alpha, "adapter")
    engines = {kind: launch_server(args.model, threads=1, max_running_requests=1, context_length=64, timeout=900)
               for kind in ("merged", "adapter")}
    try:
        with tempfile.TemporaryDirectory(prefix="fasync-lora-bench-") as work_dir:
            return asyncio.run(push_rounds({k: e.url for k, e in engines.items()}, merged_module, adapter_module,
                                           args.rounds, work_dir))
    finally:
        for engine in engines.values():
            engine.stop()


# ------------------------------------------------------------------------------ train


def train_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One process, one mode: build, optimizer, warm-up, timed steps; print the JSON."""
    import torch

    from lightning_fasync.lightning.module import RLPolicyModule

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lora = {"r": args.r, "alpha": args.alpha, "target_modules": TARGETS} if args.mode == "lora" else None
    module = RLPolicyModule(args.model, lora=lora)
    module.policy.train()
    optimizer = module.configure_optimizers()
    gen = torch.Generator().manual_seed(1)
    vocab = module.policy.config.vocab_size
    ids = torch.randint(4, vocab, (args.batch, args.seq), generator=gen)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        logits = module.policy(input_ids=ids).logits[:, :-1].float()
        loss = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).mean().neg()
        loss.backward()
        optimizer.step()

    for _ in range(2):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    params = list(module.policy.parameters())
    trainable = [p for p in params if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in trainable if p.grad is not None)
    opt_bytes = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor))
    return {"mode": args.mode, "step_s": statistics.median(times), "peak_rss_bytes": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "param_bytes": param_bytes, "trainable_params": sum(p.numel() for p in trainable),
        "grad_bytes": grad_bytes, "optimizer_bytes": opt_bytes, "params_grads_optimizer_bytes": param_bytes + grad_bytes + opt_bytes}


def bench_train(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
    for i in range(args.rounds):
        for mode in ("full", "lora"):
            cmd = [sys.executable, os.path.abspath(__file__), "_train", "--mode", mode, "--model", args.model,
                   "--r", str(args.r), "--alpha", str(args.alpha), "--threads", str(args.threads), "--steps", str(args.steps),
                   "--batch", str(args.batch), "--seq", str(args.seq)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{mode} round {i} failed: {proc.stderr[-2000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[mode].append(result)
            print(f"train {mode} round {i}: step {result['step_s']:.3f} s, peak RSS "
                  f"{result['peak_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"runs": runs}
    for mode, rs in runs.items():
        out[mode] = {"step_s": summary([r["step_s"] for r in rs]),
                     "peak_rss_mib": summary([r["peak_rss_bytes"] / 2**20 for r in rs]),
                     "params_grads_optimizer_mib": rs[0]["params_grads_optimizer_bytes"] / 2**20,
                     "optimizer_mib": rs[0]["optimizer_bytes"] / 2**20, "grad_mib": rs[0]["grad_bytes"] / 2**20,
                     "trainable_params": rs[0]["trainable_params"]}
    out["ratio_step_s"] = out["full"]["step_s"]["median"] / out["lora"]["step_s"]["median"]
    out["ratio_peak_rss"] = out["full"]["peak_rss_mib"]["median"] / out["lora"]["peak_rss_mib"]["median"]
    out["ratio_params_grads_optimizer"] = (out["full"]["params_grads_optimizer_mib"]
                                           / out["lora"]["params_grads_optimizer_mib"])
    return out


# ------------------------------------------------------------------------------ report


def _range(s: dict[str, float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def report(result: dict[str, Any], info: dict[str, Any], wall_s: float, warning: Any) -> str:
    args = result["args"]
    lines = [header("LoRA against full fine-tuning", info, wall_s, warning), "",
             f"Model `{args['model']}`, LoRA r={args['r']}, alpha={args['alpha']} on {', '.join(TARGETS)}; "
             f"{args['rounds']} rounds, median (min–max).", ""]
    push = result.get("push")
    if push:
        lines += ["## Weight push (engine_state_dict() to the engine's answer; one embedded engine per kind, one thread)", "",
                  "| push | bytes sent | seconds |", "|---|---:|---:|"]
        for kind in ("merged", "adapter"):
            lines.append(f"| {kind} | {push[kind]['bytes'] / 2**20:.2f} MiB | {_range(push[kind]['seconds'])} |")
        lines += ["", f"merged / adapter: {push['ratio_bytes']:.1f}x the bytes, {push['ratio_seconds']:.2f}x the "
                      "seconds (medians).", ""]
    train = result.get("train")
    if train:
        lines += [f"## Trainer (fresh process per round and mode, {args['threads']} thread(s), batch {args['batch']} x "
                  f"{args['seq']} tokens, {args['steps']} steps)", "",
                  "| mode | trainable params | params + grads + AdamW state | peak RSS | step time (s) |",
                  "|---|---:|---:|---:|---:|"]
        for mode in ("full", "lora"):
            t = train[mode]
            lines.append(f"| {mode} | {t['trainable_params']:,} | {t['params_grads_optimizer_mib']:.1f} MiB | "
                         f"{_range(t['peak_rss_mib'], '{:.0f}')} MiB | {_range(t['step_s'])} |")
        lines += ["", f"full / lora: {train['ratio_params_grads_optimizer']:.2f}x params + grads + optimizer state, "
                      f"{train['ratio_peak_rss']:.2f}x peak RSS, {train['ratio_step_s']:.2f}x step time (medians).", ""]
    return "\n".join(lines)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", default="all", choices=["all", "push", "train", "_train"])
    parser.add_argument("--model", default="qwen3-30m-shape")
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (the fully-async split's share)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mode", choices=["full", "lora"], default="lora", help="(_train only)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "lora"))
    args = parser.parse_args(argv)
    if args.what == "_train":
        print(json.dumps(train_worker(args)))
        return 0
    info = record()
    info["command"] = "python benchmarks/lora.py " + " ".join(sys.argv[1:] if argv is None else argv)
    warning = check_load(info)
    start = time.perf_counter()
    result: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "mode", "what")}}
    if args.what in ("all", "push"):
        result["push"] = bench_push(args)
    if args.what in ("all", "train"):
        result["train"] = bench_train(args)
    info["load_after"] = os.getloadavg()
    result["machine"] = {**info, "load_warning": warning}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = report(result, info, time.perf_counter() - start, warning)
    with open(os.path.join(args.out, "lora.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"written: {os.path.relpath(os.path.join(args.out, 'lora.md'), REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

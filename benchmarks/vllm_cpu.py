"""vLLM's CPU build beside the embedded engine and Hugging Face ``generate``, measured in one run
(docs/benchmarks.md, "vLLM on CPU").

``throughput``: the same model (``--preset``, written once as a Hugging Face directory both servers
load) on one core each, the same long-tailed workload (``engine_throughput.py``'s prompts and
lengths: ``--requests`` concurrent requests, geometric lengths of mean ``--mean-new-tokens`` capped
at ``--max-new-tokens``, EOS ignored, temperature 1.0), both engines over HTTP from a client on the
other core, HF ``generate`` as one static batch in this process on the engines' core. One after
the other in one run, each alone on that core (an idle vLLM CPU server keeps its core busy: the
run measures that too), ``--rounds`` rounds after a warm-up; tokens/s median and range of each.
With each server, the weight sync: the same tensors pushed ``--rounds`` times over its own
protocol (vLLM's RL API over the fasync-gloo engine, with and without the log-prob check; SGLang's
``/update_weights_from_tensor`` for the embedded engine), pause to resume, median and range.

``learning``: ``configs/tiny_cpu_vllm.yaml`` trained for ``--steps`` rollout steps with each seed
of ``--seeds``; the reward lift (mean of the last 5 steps minus the first 5) per seed.

    FASYNC_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/vllm_cpu.py throughput
    FASYNC_VLLM_PYTHON=.venv-vllm/bin/python python benchmarks/vllm_cpu.py learning --steps 60
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._machine import check_load, record  # noqa: E402
from benchmarks.engine_throughput import make_prompts, response_lengths  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results", "vllm")


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


async def http_round(client, batch, lengths, tag):
    from lightning_fasync.pipeline.engine_client import GenerateRequest, SamplingParams

    t0 = time.perf_counter()
    results = await asyncio.gather(*(client.generate(GenerateRequest(
        f"{tag}-{i}", p, SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)))
        for i, (p, n) in enumerate(zip(batch, lengths))))
    dt = time.perf_counter() - t0
    await client.close()
    return sum(len(r.output_ids) for r in results) / dt


def hf_round(model, batch, lengths):
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lengths), min_new_tokens=max(lengths),
                       do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
    return sum(lengths) / (time.perf_counter() - t0)


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) the processes of group ``pgid`` have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def throughput(args) -> dict:
    from lightning_fasync.config import VLLMArgs
    from lightning_fasync.fleet.client import SGLangClient
    from lightning_fasync.fleet.launch import launch_server
    from lightning_fasync.fleet.vllm import VLLMPlan, VLLMPool
    from lightning_fasync.policy import build_policy, save_policy
    from lightning_fasync.weights.sync import TensorWeightSync
    from lightning_fasync.weights.vllm_sync import VLLMWeightSync

    python = os.environ["FASYNC_VLLM_PYTHON"]
    work = tempfile.mkdtemp(prefix="fasync-vllm-bench-")
    model, tokenizer = build_policy(args.preset)
    model_dir = save_policy(model, tokenizer, os.path.join(work, "model"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    batch = make_prompts(tokenizer, args.requests)
    lengths = response_lengths(args.requests, args.mean_new_tokens, args.max_new_tokens)
    context = max(len(p) for p in batch) + args.max_new_tokens + 1
    os.sched_setaffinity(0, {0})  # the clients here; HF generate moves to the engines' core for its rounds
    torch.set_num_threads(1)
    out: dict = {"preset": args.preset, "requests": args.requests, "mean_new_tokens": args.mean_new_tokens,
                 "max_new_tokens": args.max_new_tokens, "tokens_requested": sum(lengths), "rounds": args.rounds,
                 "tokens_per_s": {}, "weight_sync_s": {},
                 "weight_bytes": sum(t.numel() * t.element_size() for t in weights.values())}

    async def pushes(sync, key, check=None):
        times = []
        for r in range(args.rounds + 1):
            if check is not None:
                sync.check_weights = check
            t0 = time.perf_counter()
            await sync.push(weights, 100 + r)
            if r:
                times.append(time.perf_counter() - t0)
        out["weight_sync_s"][key] = summary(times)

    def rounds(client_for, key):
        rates = []
        for r in range(args.rounds + 1):  # round 0 warms up and is not counted
            rate = asyncio.run(http_round(client_for(), batch, lengths, f"{key}{r}"))
            print(f"{key} round {r}: {rate:.0f} tok/s", flush=True)
            if r:
                rates.append(rate)
        out["tokens_per_s"][key] = summary(rates)

    # One server at a time on core 1: an idle vLLM CPU server keeps its core busy (measured below),
    # which would slow whatever shares the core with it.
    pool = VLLMPool(VLLMPlan(python, model_dir, None, None), VLLMArgs(max_num_seqs=args.requests), cpu_cores=[[1]],
                    context_length=context, log_dir=work, startup_timeout=900)
    try:
        pool.start()
        rounds(pool.client, "vllm")
        before = group_cpu_s(pool.servers[0].pid)
        time.sleep(5.0)
        out["vllm_idle_cpu_fraction"] = (group_cpu_s(pool.servers[0].pid) - before) / 5.0

        async def vllm_pushes():
            sync = VLLMWeightSync(pool.client(), model=model_dir, timeout_s=300)
            try:
                await pushes(sync, "vllm", check=False)
                await pushes(sync, "vllm_checked", check=True)
            finally:
                await sync.close()

        asyncio.run(vllm_pushes())
    finally:
        pool.stop()
    embedded = launch_server(model_dir, threads=1, cpu_cores=[1], context_length=context,
                             max_running_requests=args.requests, wait=False)
    try:
        embedded.wait_healthy(600)
        rounds(lambda: SGLangClient([embedded.url]), "embedded")

        async def tensor_pushes():
            sync = TensorWeightSync(SGLangClient([embedded.url]), timeout_s=300)
            try:
                await pushes(sync, "embedded_tensor")
            finally:
                await sync.close()

        asyncio.run(tensor_pushes())
    finally:
        embedded.stop()
    os.sched_setaffinity(0, {1})
    hf = []
    for r in range(args.rounds + 1):
        rate = hf_round(model, batch, lengths)
        print(f"hf_generate round {r}: {rate:.0f} tok/s", flush=True)
        if r:
            hf.append(rate)
    out["tokens_per_s"]["hf_generate"] = summary(hf)
    out["vllm_over_embedded"] = out["tokens_per_s"]["vllm"]["median"] / out["tokens_per_s"]["embedded"]["median"]
    out["vllm_over_hf_generate"] = out["tokens_per_s"]["vllm"]["median"] / out["tokens_per_s"]["hf_generate"]["median"]
    return out


def learning(args) -> dict:
    runs = []
    for seed in args.seeds:
        root = tempfile.mkdtemp(prefix=f"fasync-vllm-learn-{seed}-")
        cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu_vllm.yaml"),
               f"--seed_everything={seed}", f"--trainer.rollout_steps={args.steps}", f"--trainer.default_root_dir={root}",
               "--trainer.enable_progress_bar=false", "--trainer.save_freq=0"]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        wall = time.time() - t0
        if proc.returncode != 0:
            raise SystemExit(f"seed {seed} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        from lightning_fasync.plots import read_scalars

        (log_dir,) = glob.glob(os.path.join(root, "lightning_logs", "version_*"))
        rewards = [v for _, v in read_scalars(log_dir)["rollout/reward_mean"]]
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        runs.append({"seed": seed, "first5": first, "last5": last, "lift": last - first, "wall_s": wall,
                     "rewards": rewards})
        print(f"seed {seed}: reward {first:.3f} -> {last:.3f} (lift {last - first:+.3f}) in {wall:.0f} s", flush=True)
    return {"steps": args.steps, "config": "configs/tiny_cpu_vllm.yaml", "runs": runs,
            "lift": summary([r["lift"] for r in runs])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--preset", default="tiny-hd32")
    t.add_argument("--requests", type=int, default=64)
    t.add_argument("--mean-new-tokens", type=float, default=32)
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--rounds", type=int, default=5)
    learn = sub.add_parser("learning")
    learn.add_argument("--steps", type=int, default=40)
    learn.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    machine = record()
    machine["load_warning"] = check_load(machine)
    result = throughput(args) if args.what == "throughput" else learning(args)
    result["machine"] = machine
    result["machine_after"] = {"loadavg": os.getloadavg()}
    os.makedirs(RESULTS, exist_ok=True)
    name = f"{args.what}-{args.preset}" if args.what == "throughput" else f"learning-{args.steps}"
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs",)}, indent=1))
    print(f"written: {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()

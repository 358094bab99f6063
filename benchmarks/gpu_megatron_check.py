"""The megatron-core GPU check, prepared for one GPU (an H200 in issue 12), under 10 minutes.

A Qwen3-0.6B-shaped random bfloat16 model, built as megatron-core's ``GPTModel`` from the Hugging
Face config with the converted HF weights (``lightning_fasync.trainers.megatron``; TP = PP = 1):

1. **Logits** against the HF model on the same tokens (bf16; relative error and top-1 agreement).
2. **Export**: ``megatron_to_hf`` of the GPU model's state dict equals the HF weights exactly.
3. **Training step**: the batch (16 x 1024 tokens) through megatron-core's own path (its DDP
   wrapper, the distributed optimizer from ``get_megatron_optimizer``, ``get_forward_backward_func``,
   full activation recompute) against HF with gradient checkpointing and torch AdamW; seconds per
   step and model TFLOP/s for both; loss must be finite and fall over ``--steps`` steps on the fixed
   batch. The loss is a token-level policy-gradient surrogate with fixed advantages (the RL loss
   itself runs in step 4).

4. **RL steps**: ``lightning-fasync fit`` with ``MegatronStrategy`` on the GPU (bf16, TP = PP = 1)
   for ``--steps`` rollout steps of the ``qwen3-0.6b-shape`` preset against the embedded engine
   (which ``fit`` starts on the CPU cores), weights over the ``tensor`` path: finite losses and a
   weight push every step. On CPU (``--device cpu``) this stage is skipped: tests/integration/test_megatron_fit.py
   runs it under the test shim. Then 2 colocated steps with ``colocate_offload``: the trainer's
   megatron-core buffers and optimizer state leave the GPU between them and come back.

megatron-core must be importable: on the GPU machine (no package index) ``scripts/gpu-check``
installs the wheels ``scripts/fetch-gpu-wheels`` fetched and runs this script as the ``megatron``
stage of ``benchmarks/gpu_all.py`` (docs/gpu.md). Transformer Engine is used when importable (``te``
layer spec), else the local spec.

    python benchmarks/gpu_megatron_check.py --out "$OUT"          # one GPU
    python benchmarks/gpu_megatron_check.py --device cpu --quick  # CPU smoke run

Writes ``run.log`` and ``summary.md`` under ``--out`` (the summary after every row, so a run killed at
its deadline keeps the rows it finished) and prints the summary table last; the ``fit`` stages' run
directories go under ``--fit-root``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import time
import traceback
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def megatron_version() -> str:
    try:
        import megatron.core
    except ImportError as exc:
        raise SystemExit(f"megatron-core is not importable ({exc}): install the wheels scripts/fetch-gpu-wheels "
                         "fetches, as scripts/gpu-check does (docs/gpu.md).") from None
    return megatron.core.__version__


def hf_config(quick: bool):
    from transformers import AutoConfig

    if quick:
        return AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                    max_position_embeddings=512)
    return AutoConfig.for_model("qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                                tie_word_embeddings=True)


def model_flops_per_token(cfg, seq: int) -> float:
    """Training FLOPs per token: 6 x (non-embedding parameters + the output projection) plus
    attention's 12 x layers x heads x head_dim x seq (no causal halving); same formula both sides."""
    hd = cfg.head_dim
    attn = cfg.hidden_size * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    n = cfg.num_hidden_layers * (attn + mlp) + cfg.vocab_size * cfg.hidden_size
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * hd * seq


def pg_loss(logits, targets, adv):
    """-mean(advantage x log p(target)): a token-level policy-gradient surrogate."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return -(adv * logp).mean()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results", "gpu_megatron"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny model, few tokens: checks the script itself")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--fit-root", default=None, help="where the fit stages' run directories go (default: under --out)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    args.fit_root = args.fit_root or args.out
    log = open(os.path.join(args.out, "run.log"), "w")
    rows: list[tuple[str, str, str]] = []

    def write_summary() -> str:
        text = "| check | result | detail |\n|---|---|---|\n" + "".join(f"| {a} | {b} | {c} |\n" for a, b, c in rows)
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write(text)
        return text

    def record(name: str, fn):
        t0 = time.monotonic()
        try:
            value, note = fn()
        except Exception:
            value, note = "FAILED", "see run.log"
            log.write(f"== {name}\n{traceback.format_exc()}\n")
        log.write(f"== {name}: {value} ({note}) [{time.monotonic() - t0:.1f} s]\n")
        log.flush()
        rows.append((name, value, note))
        write_summary()

    version = megatron_version()
    import warnings

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state, tensor_parallel

    from lightning_fasync.trainers.megatron import convert
    from lightning_fasync.trainers.megatron.model import build_gpt_model, load_hf_weights
    from lightning_fasync.fleet.launch import free_port

    cuda = args.device.startswith("cuda")
    shim = contextlib.nullcontext
    if not cuda:  # the test-only CPU shim (tests/helpers/megatron_cpu.py says what it patches)
        sys.path.insert(0, os.path.join(REPO, "tests", "helpers"))
        from megatron_cpu import cpu_forward_shim as shim
    try:
        import transformer_engine  # noqa: F401
        layout = "te" if cuda else "local"
    except ImportError:
        layout = "local"
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = torch.device(args.device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if cuda:
        torch.cuda.set_device(dev)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    rows.append(("megatron-core", version, f"layer spec `{layout}`, {args.device}, {str(dtype).split('.')[-1]}"))

    cfg = hf_config(args.quick)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(dev).eval()
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    mc = build_gpt_model(cfg, layout, bf16=cuda, params_dtype=dtype, use_cpu_initialization=not cuda,
                         **(recompute if cuda else {})).to(dev)
    load_hf_weights(mc, hf.state_dict(), cfg, layout)
    mc.eval()
    batch, seq = (2, 32) if args.quick else (16, 1024)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=dev, generator=torch.Generator(dev).manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(seq, device=dev).expand(batch, seq)
    # The layer specs' attention is causal by type; on CPU the local one needs the mask given (its
    # default mask is built on "cuda").
    causal = None if cuda else torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=dev), diagonal=1)[None, None]
    adv = torch.linspace(-1.0, 1.0, batch, device=dev)[:, None].expand(batch, seq)

    def logits_check():
        """Both bf16 models against the same weights in float32 (HF): megatron-core may differ from
        it by at most twice what HF's own bf16 model does (rounding, not a bug, moves random-weight
        logits and their top-1); in float32 (the CPU run) the bound is 1e-5."""
        n = min(batch, 4)
        with torch.no_grad(), shim():
            got = mc(inputs[:n], positions[:n], attention_mask=causal).float()
            same_dtype = hf(input_ids=inputs[:n]).logits.float()
            if cuda:
                hf32 = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(dev).eval()
                hf32.load_state_dict({k: v.float() for k, v in hf.state_dict().items()})
                want = hf32(input_ids=inputs[:n]).logits.float()
                del hf32
                torch.cuda.empty_cache()
            else:
                want = same_dtype

        def rel(a):
            return ((a - want).abs().mean() / want.abs().mean()).item()

        err, hf_err = rel(got), rel(same_dtype)
        tol = max(2 * hf_err, 1e-5)
        top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        hf_top1 = (same_dtype.argmax(-1) == want.argmax(-1)).float().mean().item()
        return ("ok" if err <= tol else "MISMATCH"), (
            f"mean abs diff / mean abs logit against HF float32: {err:.2e} (HF {str(dtype).split('.')[-1]}: {hf_err:.2e}, "
            f"tolerance {tol:.2e}); top-1 agreement {top1:.1%} (HF's own {hf_top1:.1%})")

    def export_check():
        back = convert.megatron_to_hf(mc.state_dict(), cfg, layout)
        ref = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        same = back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
        return ("ok" if same else "MISMATCH"), f"{len(back)} HF tensors, torch.equal"

    flops = model_flops_per_token(cfg, seq) * batch * seq

    def megatron_train():
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mc.train()
        if not cuda:  # megatron-core's schedules allocate on "cuda": a plain step checks the rest
            opt = torch.optim.AdamW(mc.parameters(), lr=1e-5)
            losses, times = [], []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                with shim():
                    loss = pg_loss(mc(inputs, positions, attention_mask=causal), targets, adv)
                loss.backward()
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t0)
                losses.append(loss.item())
            return _train_result(losses, times, flops)
        ddp = DistributedDataParallel(mc.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), mc)
        mc.config.finalize_model_grads_func = finalize_model_grads
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, params_dtype=dtype,
                                                     use_distributed_optimizer=True, clip_grad=1.0), [ddp])
        micro = 4

        def forward_step(data_iter, model):
            i = next(data_iter)
            sl = slice(i * micro, (i + 1) * micro)
            out = model(inputs[sl], positions[sl], attention_mask=causal)
            return out, lambda o: (pg_loss(o, targets[sl], adv[sl]), {})

        fb = get_forward_backward_func()
        losses, times = [], []
        for _ in range(args.steps + 1):  # the first step warms up (allocations, kernels)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ddp.zero_grad_buffer()
            opt.zero_grad()
            fb(forward_step_func=forward_step, data_iterator=iter(range(batch // micro)), model=[ddp],
               num_microbatches=batch // micro, seq_length=seq, micro_batch_size=micro, forward_only=False)
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            with torch.no_grad():
                losses.append(pg_loss(mc(inputs[:micro], positions[:micro], attention_mask=causal),
                                      targets[:micro], adv[:micro]).item())
        return _train_result(losses[1:], times[1:], flops)

    def hf_train():
        hf.train()
        if cuda:
            hf.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=cuda)
        losses, times = [], []
        for _ in range(args.steps + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = pg_loss(hf(input_ids=inputs).logits, targets, adv)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        return _train_result(losses[1:], times[1:], flops)

    record("logits vs HF", logits_check)
    record("export Megatron -> HF", export_check)
    record(f"train step, megatron-core ({batch} x {seq} tokens)", megatron_train)
    record(f"train step, HF + torch AdamW ({batch} x {seq} tokens)", hf_train)
    if cuda:
        record("RL steps via MegatronStrategy + embedded engine (tensor sync)", lambda: rl_fit(args, log))
        record("colocated RL steps, trainer offloaded between them", lambda: rl_fit(args, log, colocate=True))
    else:
        rows.append(("RL steps via MegatronStrategy + embedded engine (tensor sync)", "skipped on CPU",
                     "tests/integration/test_megatron_fit.py runs it on CPU ranks under the test shim"))

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    summary = write_summary()
    log.close()
    print(summary)
    bad = any(r[1] in ("FAILED", "MISMATCH", "INCOMPLETE") or r[2].startswith("LOSS NOT FALLING") for r in rows)
    return 1 if bad else 0


def rl_fit(args, log, colocate: bool = False) -> tuple[str, str]:
    """``lightning-fasync fit`` with MegatronStrategy on this GPU (TP = PP = 1, bf16) for ``--steps``
    rollout steps of the Qwen3-0.6B-shaped preset against the embedded engine (on the CPU cores, as
    ``fit`` starts it), weights over the ``tensor`` path: finite losses, weights pushed every step.
    ``colocate``: 2 colocated steps instead, the trainer's buffers and optimizer state offloaded to
    the host between them (``MegatronPolicyModule.offload_train``) and back."""
    from lightning_fasync.plots import read_scalars

    steps = 2 if colocate else args.steps
    root = os.path.join(args.fit_root, "fit-colocate" if colocate else "fit")
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
           "--model.model=qwen3-0.6b-shape", "--model.mixed_precision=bf16", "--model.micro_batch_size=4",
           "--model.lr_schedule=constant", "--model.grad_clip=1.0", "--trainer.gradient_clip_val=null",
           "--trainer.strategy=MegatronStrategy", "--trainer.accelerator=gpu", "--trainer.devices=1",
           f"--trainer.rollout_steps={steps}", f"--trainer.default_root_dir={root}", "--trainer.save_freq=0",
           "--trainer.enable_progress_bar=false", "--rollout.weight_sync=tensor", "--rollout.max_response_length=32",
           "--data_source.num_prompts_per_step=4", "--data_source.num_trajectories_per_prompt=4",
           "--trainer.mini_batch_size=8", "--algorithm.entropy_coef=0.001"]
    if colocate:
        cmd += ["--colocate=true", "--fully_async.enable=false", "--colocate_offload=true"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    log.write(f"== fit\n{' '.join(cmd)}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}\n")
    if proc.returncode != 0:
        return "FAILED", f"exit {proc.returncode} after {time.monotonic() - t0:.0f} s (run.log)"
    runs = sorted(os.listdir(os.path.join(root, "lightning_logs")))
    tb = read_scalars(os.path.join(root, "lightning_logs", runs[-1]))
    losses = [v for _, v in tb.get("train/loss", [])]
    train = sorted(v for _, v in tb.get("timing/train", []))
    sync = sorted(v for _, v in tb.get("timing/update_weights", []))
    ok = len(losses) == steps and all(math.isfinite(v) for v in losses) and len(sync) >= steps - 1
    if colocate:
        moved = [v for _, v in tb.get("timing/offload_train", [])] + [v for _, v in tb.get("timing/onload_train", [])]
        ok = ok and len(moved) >= 2
        return ("ok" if ok else "INCOMPLETE"), (
            f"{len(losses)} steps, losses {', '.join(f'{v:.3g}' for v in losses)}; offload/onload "
            f"{', '.join(f'{v:.2f}' for v in moved)} s")
    return ("ok" if ok else "INCOMPLETE"), (
        f"{len(losses)} steps, losses {', '.join(f'{v:.3g}' for v in losses)}; median timing/train "
        f"{train[len(train) // 2] if train else float('nan'):.2f} s, update_weights "
        f"{sync[len(sync) // 2] if sync else float('nan'):.2f} s")


def _train_result(losses: list[float], times: list[float], flops: float) -> tuple[str, str]:
    finite = all(math.isfinite(x) for x in losses)
    falling = finite and losses[-1] < losses[0]
    step = sorted(times)[len(times) // 2]
    status = "ok" if falling else "LOSS NOT FALLING"
    return (f"{step:.3f} s/step, {flops / step / 1e12:.1f} TFLOP/s",
            f"{status}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps (median step)")


if __name__ == "__main__":
    sys.exit(main())

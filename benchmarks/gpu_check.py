"""The GPU checks, in one prepared run of under 10 minutes on one GPU (an H200 in the issues).

1. **Weight sync over CUDA IPC** (``benchmarks/weight_sync.py --device cuda``): a Qwen3-0.6B-shaped
   random bfloat16 model in this process (the trainer) and the embedded engine with ``--device
   cuda`` in a second process on the same GPU; the ``tensor`` path (flattened buckets in device
   memory, sent as CUDA IPC handles) and ``disk``, each against its medium (a device-to-device
   copy of the same tensors; a file written and read). ``distributed`` is not run: NCCL refuses
   two ranks on one device.
2. **Engine throughput** (``benchmarks/engine_throughput.py --device cuda``): the same model,
   64 requests x 512 new tokens (the uniform scenario), the engine over HTTP against HF
   ``generate`` with the whole batch at once, in one run.

Real SGLang is not part of it: its GPU runtime cannot be installed where these checks run, so
the ``sglang`` backend's launch path is tested on CPU with a stand-in ``sglang.launch_server``.

    python benchmarks/gpu_check.py --out "$OUT"          # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --quick   # a CPU smoke run of the same script

Writes each step's log and ``summary.md`` under ``--out`` and prints the summary table last.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list[str], log: str, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` with a wall-clock limit, its output into ``log``; (exit status, output)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        out = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMED OUT after {timeout:.0f} s"
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}\n[exit {code} after {time.monotonic() - t0:.0f} s]\n")
    return code, out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "benchmarks", "results", "gpu_check"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny model, few tokens: checks the script itself")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    py = sys.executable
    if args.quick:
        model, dtype, requests, new_tokens, ws_extra = "tiny", "float32", 4, 8, ["--repeats", "1"]
    else:
        model, dtype, requests, new_tokens, ws_extra = "qwen3-0.6b-shape", "bfloat16", 64, 512, ["--repeats", "3"]
    rows: list[tuple[str, str, str]] = []

    ws_dir = os.path.join(args.out, "weight_sync")
    code, out = run([py, "benchmarks/weight_sync.py", "--device", args.device, "--models", model, "--dtypes", dtype,
                     "--paths", "tensor,disk", "--no-sharded", "--out", ws_dir, *ws_extra],
                    os.path.join(args.out, "weight_sync.log"), 240)
    if code == 0:
        with open(os.path.join(ws_dir, "results.csv")) as f:
            for r in csv.DictReader(f):
                rows.append((f"weight sync `{r['path']}` ({r['dtype']}, {r['mb']} MB)",
                             f"{float(r['gb_s']):.1f} GB/s, push {float(r['push_s']):.3f} s",
                             f"{float(r['ratio']):.0%} of {r['medium']} ({float(r['medium_gb_s']):.1f} GB/s)"))
    else:
        rows.append(("weight sync", f"FAILED (exit {code})", "see weight_sync.log"))

    code, out = run([py, "benchmarks/engine_throughput.py", "--device", args.device, "--preset", model, "--dtype", dtype,
                     "--requests", str(requests), "--max-new-tokens", str(new_tokens), "--max-running-requests",
                     str(requests), "--scenarios", "uniform", "--repeats", "2", "--sequential-sample", "0",
                     "--context-length", str(new_tokens + 64)],
                    os.path.join(args.out, "engine_throughput.log"), 300)
    hf = re.search(r"\[uniform\] HF generate .*median ([\d,]+) tokens/s", out)
    eng = re.search(r"\[uniform\] embedded engine .*median ([\d,]+) tokens/s", out)
    ratio = re.search(r"\[uniform\] ratio engine / HF generate: best ([\d.]+)x, median ([\d.]+)x", out)
    if code == 0 and hf and eng and ratio:
        rows.append((f"engine over HTTP, {requests} x {new_tokens} tokens", f"{eng.group(1)} tokens/s (median)",
                     f"HF generate {hf.group(1)} tokens/s; engine / HF {ratio.group(2)}x (best {ratio.group(1)}x)"))
    else:
        rows.append(("engine throughput", f"FAILED (exit {code})", "see engine_throughput.log"))

    lines = [f"# GPU check ({args.device}{', quick' if args.quick else ''}; {time.strftime('%Y-%m-%d %H:%M:%S %Z')})", "",
             "| check | measured | against |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if not any("FAILED" in b for _, b, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

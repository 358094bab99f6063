"""Trainer throughput with sequence packing against padding (docs/packing.md), side by side.

A training call of ``RLPolicyModule`` (old log-probs, forward, loss, backward: what one optimizer
update costs the trainer, without the optimizer step) on the main job's batch shape: M = 32
sequences per call (4 groups of 8), the ``tiny`` policy, the main job's algorithm (token IS
correction, loglinear proximal log-probs), one torch thread (the main job's trainer core). The
lengths are real ones: ``record`` runs the main job (``configs/tiny_cpu.yaml``, its 120 rollout
steps) and writes every training call's prompt and response lengths; the benchmark replays calls
evenly spaced over that run with random token ids. A second workload stretches each response 16x (the same distribution with a 16x
longer tail: 1 to 1040 tokens).

Forwards compared, each round timing every one on the same calls in turn (rounds interleaved, so
a drift in the machine's load touches every forward alike):

- ``padded``: ``trainer.pack_sequences: false``, the plain right-padded [B, L] forward;
- ``packed``: the default, rows packed first-fit decreasing, none longer than the call's longest
  sequence (sdpa's block-diagonal mask from the positions);
- ``packed-one-row``: every sequence in one row (the ``flat`` layout FlashAttention's varlen path
  uses), on sdpa: the quadratic cost of one long masked row (main job only, see ``SKIP``);
- ``packed-micro``: ``packed`` with ``trainer.max_tokens_per_micro_batch`` (256 tokens; 4096 on
  the long-tail workload), the call in several forwards and backwards.

Figures: real tokens (prompt + response, not padding) per second of the training call, median and
range over rounds; the ratio to ``padded`` is each round's own ratio, median (range). Written to
``--out`` (default ``benchmarks/results/packing/``): ``packing.md`` (machine record, tables),
``packing.json`` (every timing), and ``lengths.json`` (the recorded calls, from ``record``).

    python benchmarks/packing.py record            # the main job's lengths: its 120 rollout steps, ~80 s
    python benchmarks/packing.py                   # 5 rounds on the recorded lengths, a few minutes
    python benchmarks/packing.py --quick           # 1 round, fewer calls: a smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from _machine import check_load, header, record  # noqa: E402

OUT = os.path.join(HERE, "results", "packing")
FORWARDS = ("padded", "packed", "packed-one-row", "packed-micro")
WORKLOADS = {"main job": 1, "16x longer tails": 16}
BUDGET = {"main job": 256, "16x longer tails": 4096}
CALLS = {"main job": 16, "16x longer tails": 4}
"""Training calls timed per forward and round (a 16x call is ~15x the tokens), evenly spaced over the
recorded run: its early calls (the untrained policy runs to the length limit) and its late ones."""
SKIP = {"16x longer tails": ("packed-one-row",)}
"""One row of ~25,000 tokens under sdpa's dense mask: ~20x slower than padding in a one-round trial,
minutes per round; the main job's one-row figure shows the same quadratic cost."""


# ------------------------------------------------------------------------------ recording the lengths


try:
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:  # only `record` needs Lightning at import time of the fit
    _Callback = object  # type: ignore[assignment,misc]


class LengthRecorder(_Callback):  # type: ignore[misc]
    """A Lightning callback for ``lightning-fasync fit``: after each training call, its sequences'
    ``[prompt, response]`` lengths, appended as one JSON line to ``$FASYNC_PACKING_LENGTHS``."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        groups = getattr(batch, "groups", None) or []
        rows = [[len(t.prompt_ids), len(t.response_ids)] for g in groups for t in g.trajectories]
        with open(os.environ["FASYNC_PACKING_LENGTHS"], "a") as fh:
            fh.write(json.dumps(rows) + "\n")


def record_lengths(out: str, steps: int) -> str:
    """Run the main job for ``steps`` rollout steps and keep each training call's lengths."""
    path = os.path.join(out, "lengths.json")
    with tempfile.TemporaryDirectory(prefix="fasync-packing-") as tmp:
        lines = os.path.join(tmp, "calls.jsonl")
        env = {**os.environ, "FASYNC_PACKING_LENGTHS": lines, "PYTHONPATH": os.pathsep.join([HERE, REPO])}
        cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
               f"--trainer.rollout_steps={steps}", f"--trainer.default_root_dir={tmp}", "--trainer.save_freq=0",
               "--trainer.enable_progress_bar=false", "--trainer.callbacks+=packing.LengthRecorder"]
        subprocess.run(cmd, check=True, cwd=REPO, env=env)
        with open(lines) as fh:
            calls = [json.loads(line) for line in fh if line.strip()]
    responses = [r for call in calls for _, r in call]
    with open(path, "w") as fh:
        # The command as run, with the checkout's config path relative and the temporary run directory named so.
        shown = ["lightning-fasync", *(a.replace(REPO + os.sep, "").replace(tmp, "<tmp>") for a in cmd[3:])]
        json.dump({"command": " ".join(shown), "steps": steps, "calls": calls,
                   "response_length": {"mean": statistics.mean(responses), "median": statistics.median(responses),
                                       "max": max(responses), "min": min(responses)}}, fh)
    print(f"{len(calls)} training calls recorded to {os.path.relpath(path, REPO)}", file=sys.stderr)
    return path


# ------------------------------------------------------------------------------ timing


def _groups(call: list[list[int]], stretch: int, rng: random.Random, group_size: int = 8) -> list[Any]:
    """One recorded call as groups of random tokens with those lengths (responses x ``stretch``)."""
    from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus

    groups = []
    for g in range(0, len(call), group_size):
        rows = call[g:g + group_size]
        prompt = [1] + [rng.randrange(4, 90) for _ in range(rows[0][0] - 1)]
        trajs = []
        for i, (_, response) in enumerate(rows):
            t = Trajectory(prompt_id=PromptId(0, g), sample_index=i, prompt_ids=prompt,
                           status=TrajectoryStatus.COMPLETED, reward=rng.random())
            n = max(1, response * stretch)
            t.extend([rng.randrange(4, 90) for _ in range(n)], [-1.0] * n, [0] * n)
            trajs.append(t)
        groups.append(TrajectoryGroup(PromptSample(PromptId(0, g), prompt), 0, trajs))
    return groups


def _module(forward: str, workload: str) -> Any:
    from lightning_fasync.config import load_config
    from lightning_fasync.lightning.module import RLPolicyModule

    cfg = load_config({"algorithm": {"is_correction": {"enable": True}, "prox_logp_method": "loglinear"}})
    args = {**RLPolicyModule.algorithm_args(cfg), "pack_sequences": forward != "padded"}
    if forward == "packed-micro":
        args["max_tokens_per_micro_batch"] = BUDGET[workload]
    module = RLPolicyModule("tiny", **args)
    if forward == "packed-one-row":
        module._packing = "flat"  # the one-row layout, measured on sdpa
    return module


def _time_call(module: Any, groups: list[Any]) -> float:
    from lightning_fasync.lightning.batch import RolloutBatch

    start = time.perf_counter()
    batch = RolloutBatch(groups=groups, rollout_step=1, call_index=1, calls_per_step=2,
                         data=module.prepare_rollout_batch(groups))
    loss = module.training_step(batch, 1)
    loss.backward()
    elapsed = time.perf_counter() - start
    module.policy.zero_grad(set_to_none=True)
    return elapsed


def run(lengths_path: str, rounds: int, calls_scale: float, seed: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    with open(lengths_path) as fh:
        recorded = json.load(fh)
    rng = random.Random(seed)
    pool = [c for c in recorded["calls"] if c]
    results: dict[str, Any] = {"lengths": os.path.relpath(lengths_path, REPO), "workloads": {}}
    for workload, stretch in WORKLOADS.items():
        calls_per_round = max(1, round(CALLS[workload] * calls_scale))
        forwards = [f for f in FORWARDS if f not in SKIP.get(workload, ())]
        picked = [pool[int((i + 0.5) * len(pool) / calls_per_round)] for i in range(calls_per_round)]
        calls = [_groups(call, stretch, rng) for call in picked]
        tokens = sum(len(t.prompt_ids) + len(t.response_ids) for groups in calls for g in groups for t in g.trajectories)
        padded = sum(len(groups) * 8 * max(len(t.prompt_ids) + len(t.response_ids) for g in groups for t in g.trajectories)
                     for groups in calls)
        modules = {f: _module(f, workload) for f in forwards}
        for module in modules.values():  # warm-up: the first call of each (allocator, the packing probe)
            _time_call(module, calls[0])
        seconds: dict[str, list[float]] = {f: [] for f in forwards}
        for r in range(rounds):
            order = forwards if r % 2 == 0 else forwards[::-1]
            for f in order:
                seconds[f].append(sum(_time_call(modules[f], groups) for groups in calls))
            print(f"{workload}: round {r + 1}/{rounds}: " + ", ".join(f"{f} {tokens / seconds[f][-1]:.0f} tok/s"
                                                                      for f in forwards), file=sys.stderr, flush=True)
        results["workloads"][workload] = {"stretch": stretch, "calls": calls_per_round, "tokens": tokens,
                                          "padded_tokens": padded, "budget": BUDGET[workload], "seconds": seconds}
    return results


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})"


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}–{max(values):.2f})"


def report(results: dict[str, Any], info: dict[str, Any], warning: Optional[str], wall_s: float) -> str:
    lines = [header("Trainer throughput: packed against padded (benchmarks/packing.py)", info, wall_s, warning), ""]
    lines.append(f"Lengths: {results['lengths']} ({results.get('recorded', '')}).")
    lines.append("Real tokens (prompt + response) per second of a training call (old log-probs, forward, loss, "
                 "backward), one torch thread, the `tiny` policy, M = 32; median (range) over rounds. Ratios are "
                 "each round's own, against `padded`.")
    for workload, w in results["workloads"].items():
        tokens, seconds = w["tokens"], w["seconds"]
        lines += ["", f"## {workload} (responses x{w['stretch']}; {w['calls']} calls per round, {tokens} real tokens, "
                      f"{w['padded_tokens']} padded; micro-batch budget {w['budget']} tokens)", "",
                  "| forward | tokens/s | against padded |", "|---|---|---|"]
        for f, secs in seconds.items():
            rate = [tokens / s for s in secs]
            ratio = [p / s for p, s in zip(seconds["padded"], secs)]
            lines.append(f"| {f} | {_summary(rate)} | {_ratio(ratio)} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", default="bench", choices=["bench", "record"])
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--lengths", default=None, help="the recorded lengths (default: OUT/lengths.json)")
    parser.add_argument("--steps", type=int, default=120, help="rollout steps of the recording run (the main job's 120)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=float, default=1.0, help="scale the training calls timed per forward and round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 round, a quarter of the calls")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.what == "record":
        record_lengths(args.out, args.steps)
        return
    if args.quick:
        args.rounds, args.calls = 1, 0.25
    info = record()
    info["command"] = "python benchmarks/packing.py " + " ".join(argv if argv is not None else sys.argv[1:])
    warning = check_load(info)
    start = time.perf_counter()
    lengths = args.lengths or os.path.join(args.out, "lengths.json")
    results = run(lengths, args.rounds, args.calls, args.seed)
    with open(lengths) as fh:
        rec = json.load(fh)
    real = sum(p + r for call in rec["calls"] for p, r in call)
    padded = sum(len(call) * max(p + r for p, r in call) for call in rec["calls"] if call)
    results["recorded"] = (f"{len(rec['calls'])} training calls of `{rec['command']}`; response length mean "
                           f"{rec['response_length']['mean']:.1f}, median {rec['response_length']['median']}, "
                           f"max {rec['response_length']['max']}; over the whole run real tokens are "
                           f"{100 * real / padded:.0f} % of the padded batches")
    info["load_after"] = os.getloadavg()
    wall = time.perf_counter() - start
    with open(os.path.join(args.out, "packing.json"), "w") as fh:
        json.dump({"machine": {**info, "warning": warning}, **results}, fh, indent=1)
    text = report(results, info, warning, wall)
    with open(os.path.join(args.out, "packing.md"), "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()

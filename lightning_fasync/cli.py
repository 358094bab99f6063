"""The ``lightning-fasync`` command: ``simulate`` and ``serve`` (``fit`` arrives with the Lightning
integration).

Overrides follow the config keys of the spec: ``--fully_async.stale_steps=2``,
``--rollout.partial=true``. Values are parsed as YAML scalars.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from typing import Any, Optional, Sequence

import yaml

from lightning_fasync.config import ConfigError, FasyncConfig, config_from_dict, set_by_path, validate


def _split_overrides(extra: Sequence[str]) -> list[tuple[str, Any]]:
    out = []
    items = list(extra)
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise ConfigError(f"Unexpected argument {item!r}; overrides look like --section.key=value.")
        key, eq, value = item[2:].partition("=")
        if not eq:
            if i + 1 >= len(items):
                raise ConfigError(f"`{key}` is given without a value; write --{key}=VALUE.")
            value = items[i + 1]
            i += 1
        out.append((key, yaml.safe_load(value)))
        i += 1
    return out


def load_config(path: Optional[str], overrides: Sequence[tuple[str, Any]] = ()) -> tuple[FasyncConfig, dict[str, Any]]:
    """Read a YAML config (plugin keys plus optional extra sections) and apply overrides.

    Returns the plugin config and the extra top-level sections (e.g. ``simulate``).
    """
    data: dict[str, Any] = {}
    if path is not None:
        if not os.path.exists(path):
            raise ConfigError(f"`--config` is {path!r}, which does not exist.")
        with open(path) as fh:
            try:
                data = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"`--config` {path!r} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"`--config` {path!r} must hold a mapping of config keys.")
    extra = {k: data.pop(k) for k in list(data) if k in ("simulate",)}
    cfg = config_from_dict(data)
    for key, value in overrides:
        if key.split(".")[0] in extra or key.startswith("simulate."):
            _set_nested(extra, key, value)
        else:
            set_by_path(cfg, key, value)
    return cfg, extra


def _set_nested(d: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


def _simulate(argv: Sequence[str]) -> int:
    from lightning_fasync.simulate import SimConfig, format_table, load_trace, run_variants
    from lightning_fasync.config import _build

    parser = argparse.ArgumentParser(
        prog="lightning-fasync simulate",
        description="Run the fully-async pipeline on a virtual clock and compare against colocate.",
    )
    parser.add_argument("--config", help="YAML with plugin keys and a `simulate:` section.")
    parser.add_argument("--trace", help="JSONL response-length trace: {\"prompt\": i, \"lengths\": [N ints]} per line.")
    parser.add_argument("--events", help="Write the event log (JSONL) here; one file per variant.")
    parser.add_argument("--output", help="Write the table here (.md or .csv).")
    parser.add_argument("--steps", type=int, help="Override simulate.steps.")
    args, extra = parser.parse_known_args(argv)
    cfg, sections = load_config(args.config, _split_overrides(extra))
    sim = _build(SimConfig, sections.get("simulate") or {}, "simulate")
    if args.steps is not None:
        if args.steps < 2:
            raise ConfigError(f"`--steps` is {args.steps}; at least 2 steps are needed to report steady state.")
        sim.steps = args.steps
    trace = load_trace(args.trace) if args.trace else None
    if trace is not None:
        sim.num_prompts = min(sim.num_prompts, len(trace)) if sim.num_prompts else len(trace)
    t0 = time.perf_counter()
    rows = run_variants(cfg, sim, trace=trace, events_path=args.events)
    table = format_table(rows)
    print(table)
    print(f"\n{sim.steps} simulated steps per run, {len(rows)} runs, {time.perf_counter() - t0:.1f} s wall time.")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        if args.output.endswith(".csv"):
            with open(args.output, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
        else:
            with open(args.output, "w") as fh:
                fh.write(table + "\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv_is_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("simulate", "serve", "fit")
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lightning-fasync {simulate,serve,fit} ...\n\n"
              "  simulate  plan a run on a virtual clock (colocate vs fully-async)\n"
              "  serve     start one embedded rollout engine (SGLang native API)\n"
              "  fit       train (Lightning integration)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in commands:
        print(f"lightning-fasync: unknown command {command!r}; choose one of {', '.join(commands)}.", file=sys.stderr)
        return 2
    try:
        if command == "simulate":
            try:
                return _simulate(rest)
            except (ValueError, FileNotFoundError) as exc:  # a bad trace or config file
                print(f"lightning-fasync simulate: error: {exc}", file=sys.stderr)
                return 2
        if command == "serve":
            from lightning_fasync.rollout.server import main as serve_main

            return serve_main(rest)
        from lightning_fasync.lightning.cli import main as fit_main

        # `lightning-fasync fit ...` as a process: LightningCLI reads sys.argv itself, so that a
        # DDP launcher can re-run the same command line for each rank.
        return fit_main(None if argv_is_process else rest)
    except ConfigError as exc:
        print(f"lightning-fasync {command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

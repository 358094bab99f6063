"""The ``lightning-fasync`` command: ``fit``, ``simulate``, ``plan``, ``serve`` and ``export``.

Every command parses with jsonargparse from the dataclasses in :mod:`lightning_fasync.config`
(their field docstrings are the ``--help``): overrides follow the spec's keys,
``--fully_async.stale_steps=2``, ``--rollout.partial=true``.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from typing import Optional, Sequence

from lightning_fasync.config import ConfigError, config_from_namespace, config_parser


def _simulate(argv: Sequence[str]) -> int:
    from lightning_fasync.simulate import SimConfig, format_table, load_trace, run_variants

    parser = config_parser(simulate=SimConfig)
    parser.prog = "lightning-fasync simulate"
    parser.description = "Run the fully-async pipeline on a virtual clock and compare against colocate."
    parser.add_argument("--trace", type=Optional[str], default=None,
                        help='JSONL response-length trace: {"prompt": i, "lengths": [N ints]} per line.')
    parser.add_argument("--events", type=Optional[str], default=None, help="Write the event log (JSONL) here; one file per variant.")
    parser.add_argument("--output", type=Optional[str], default=None, help="Write the table here (.md or .csv).")
    parser.add_argument("--steps", type=Optional[int], default=None, help="Override simulate.steps.")
    try:
        ns = parser.parse_args(list(argv))
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except Exception as exc:  # jsonargparse's ArgumentError
        from lightning_fasync.config import _config_error_sentence

        raise ConfigError(_config_error_sentence(exc)) from None
    cfg, sections = config_from_namespace(ns, simulate=SimConfig)
    sim = sections["simulate"]
    if ns.steps is not None:
        if ns.steps < 2:
            raise ConfigError(f"`--steps` is {ns.steps}; at least 2 steps are needed to report steady state.")
        sim.steps = ns.steps
    trace = load_trace(ns.trace) if ns.trace else None
    if trace is not None:
        sim.num_prompts = min(sim.num_prompts, len(trace)) if sim.num_prompts else len(trace)
    t0 = time.perf_counter()
    rows = run_variants(cfg, sim, trace=trace, events_path=ns.events)
    table = format_table(rows)
    print(table)
    print(f"\n{sim.steps} simulated steps per run, {len(rows)} runs, {time.perf_counter() - t0:.1f} s wall time.")
    if ns.output:
        os.makedirs(os.path.dirname(os.path.abspath(ns.output)), exist_ok=True)
        if ns.output.endswith(".csv"):
            with open(ns.output, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
        else:
            with open(ns.output, "w") as fh:
                fh.write(table + "\n")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv_is_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("simulate", "plan", "serve", "fit", "export")
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lightning-fasync {simulate,plan,serve,fit,export} ...\n\n"
              "  simulate  plan a run on a virtual clock (colocate vs fully-async)\n"
              "  plan      profile a config briefly, predict every mode's speed, recommend one\n"
              "  serve     start one embedded rollout engine (SGLang native API)\n"
              "  fit       train (Lightning integration)\n"
              "  export    write a checkpoint's policy as a Hugging Face directory")
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
        if command == "plan":
            from lightning_fasync.plan import main as plan_main

            try:
                return plan_main(rest)
            except (ValueError, FileNotFoundError, RuntimeError) as exc:  # a failed profile run, a bad file
                print(f"lightning-fasync plan: error: {exc}", file=sys.stderr)
                return 2
        if command == "export":
            from lightning_fasync.export.hf import main as export_main

            return export_main(rest)
        if command == "serve":
            from lightning_fasync.engine.server import main as serve_main

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

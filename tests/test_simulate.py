"""The simulator: deterministic, fast, the spec's table shape, trace replay, event log."""

import json
import os
import subprocess
import sys

import pytest

from lightning_fasync.cli import main
from lightning_fasync.config import load_config_file
from lightning_fasync.pipeline.events import EVENTS, read_jsonl
from lightning_fasync.simulate import RunReplay, SimConfig, Simulation, Variant, run_variants
from tests.helpers.paths import REPO

DAPO = os.path.join(REPO, "configs", "sim", "dapo_h20.yaml")


def dapo(steps=6):
    cfg, sections = load_config_file(DAPO, simulate=SimConfig)
    sim = sections["simulate"]
    sim.steps = steps
    return cfg, sim


def test_fully_async_beats_colocate_on_the_spec_experiment():
    cfg, sim = dapo(steps=12)
    rows = {r["config"]: r for r in run_variants(cfg, sim)}
    colocate = rows["colocate"]
    best = rows["fully_async (windowed-fifo, stale = 2.0)"]
    fully_async = [r for name, r in rows.items() if name.startswith("fully_async")]
    assert len(fully_async) == 3
    # Every fully-async variant (8 GPUs train, 8 roll out) takes less time per step than colocate
    # (16 GPUs time-shared), counting step 0 and in the steady state.
    for r in fully_async:
        assert r["resource"] == "8:8" and colocate["resource"] == "colocate"
        assert r["avg_step"] < colocate["avg_step"], r["config"]
        assert r["avg_step_excl0"] < colocate["avg_step_excl0"], r["config"]
    # The best one by more than 10% in the steady state, against both colocate baselines, and the
    # table's speedup column is that ratio of step times.
    assert colocate["avg_step_excl0"] > 1.1 * best["avg_step_excl0"]
    assert rows["colocate + partial"]["avg_step_excl0"] > 1.1 * best["avg_step_excl0"]
    assert best["speedup_excl0"] == pytest.approx(colocate["avg_step_excl0"] / best["avg_step_excl0"])
    assert colocate["pipeline_buf_size"] is None and best["pipeline_buf_size"] > 0
    # Step 0 fills the buffer, so it is slower than the steady state.
    assert best["avg_step"] > best["avg_step_excl0"]


def test_deterministic_for_a_seed():
    cfg, sim = dapo(steps=4)
    sim.variants = [Variant("a", {})]
    a = run_variants(cfg, sim)[0]
    b = run_variants(cfg, sim)[0]
    assert a == b


def test_consumes_exactly_b_groups_per_step():
    cfg, sim = dapo(steps=5)
    run = Simulation(cfg, sim).run()
    assert len(run.step_metrics) == 5
    assert all(m["rollout/consumed_groups"] == cfg.B for m in run.step_metrics)
    assert len(run.step_times) == 5 and all(t > 0 for t in run.step_times)


def test_trace_replay_and_event_log(tmp_path):
    trace = tmp_path / "trace.jsonl"
    with open(trace, "w") as fh:
        for i in range(512):
            fh.write(json.dumps({"prompt": i, "lengths": [100 + (i * 37 + j * 11) % 900 for j in range(8)]}) + "\n")
    events = tmp_path / "events.jsonl"
    out = tmp_path / "table.md"
    rc = main(["simulate", "--config", DAPO, "--trace", str(trace), "--events", str(events), "--output", str(out),
               "--steps", "3", "--simulate.variants", "[{name: only, overrides: {}}]"])
    assert rc == 0
    rows = read_jsonl(str(events))
    assert rows and {r["event"] for r in rows} <= set(EVENTS)
    assert {"dispatch", "complete", "collect", "consume", "pause", "resume", "sync"} <= {r["event"] for r in rows}
    assert all(r["R"] + r["Q"] <= 128 for r in rows)
    assert "| only |" in out.read_text()
    # The trace drove the run: its answers (100 to 999 tokens, against the config's log-normal up to
    # 20480) make the steps shorter than the same command's without it.
    plain = tmp_path / "plain.md"
    assert main(["simulate", "--config", DAPO, "--output", str(plain),
                 "--steps", "3", "--simulate.variants", "[{name: only, overrides: {}}]"]) == 0

    def avg_step(path):
        row = next(r for r in path.read_text().splitlines() if r.startswith("| only |"))
        return float(row.split("|")[3])

    assert avg_step(out) < avg_step(plain)


def test_a_replayed_run_hands_out_its_groups_in_the_order_it_consumed_them():
    """The k-th group handed out is one of the ``spread`` around the run's k-th (past the run's end,
    one of its last); a simulation replaying a run whose answers shrink has steps that shrink with them."""
    run = [[k] * 2 for k in range(40)]
    replay = RunReplay([run], spread=4, seed=3)
    got = [replay.next()[0] for _ in range(50)]
    window = lambda k: range(min(max(0, k - 2), 36), min(max(0, k - 2), 36) + 4)  # noqa: E731 (shifted in at the ends)
    assert all(g in window(k) for k, g in enumerate(got)), got
    assert got[:40] != list(range(40))  # drawn around the position, not the run copied
    assert RunReplay([run], 4, 3).next() == [got[0]] * 2  # a seed's draws are its own
    with pytest.raises(ValueError, match="spread is 0; it must be >= 1"):
        RunReplay([run], 0, 0)
    with pytest.raises(ValueError, match="at least one run"):
        RunReplay([[]], 4, 0)

    cfg, sim = dapo(steps=6)
    sim.num_prompts = 2048
    shrinking = [[2000] * cfg.N] * (3 * cfg.B) + [[100] * cfg.N] * (3 * cfg.B)
    steps = Simulation(cfg, sim, replay=RunReplay([shrinking], cfg.B, 0)).run().step_metrics
    means = [m["rollout/response_length_mean"] for m in steps]
    assert means[0] > 1500 and means[-1] < 400, means  # early steps the long answers, late ones the short
    with pytest.raises(ValueError, match="a trace or a replay of whole runs, not both"):
        Simulation(cfg, sim, trace={0: [1] * cfg.N}, replay=RunReplay([shrinking], cfg.B, 0))


def test_bad_trace_and_bad_override_are_clear_errors(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"prompt": 0}\n')
    assert main(["simulate", "--config", DAPO, "--trace", str(trace)]) == 2
    assert "each trace line must be" in capsys.readouterr().err
    assert main(["simulate", "--config", DAPO, "--fully_async.stale_steps=-1"]) == 2
    assert "`fully_async.stale_steps`" in capsys.readouterr().err


def test_cli_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_fasync.cli", "simulate", "--config", DAPO, "--steps", "2"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| colocate |" in proc.stdout and "speedup" in proc.stdout

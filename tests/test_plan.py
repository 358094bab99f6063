"""``lightning-fasync plan``: the fits recover what they fit, a simulate: config is planned without a
profile, and a real profile of the main job gives a table of every mode with a recommendation."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from lightning_fasync.config import ConfigError
from lightning_fasync.plan import (MODES, Profile, RunProfile, TrainerFit, batch_cost, fit_curve, fit_trainer, main,
                                   predict, read_lengths)
from tests.helpers.paths import REPO

DAPO = os.path.join(REPO, "configs", "sim", "dapo_h20.yaml")


def test_the_engine_curve_fit_recovers_peak_and_half_saturation():
    peak, half = 9000.0, 6.0
    points = [(c, peak * c / (c + half)) for c in (1, 2, 4, 8, 16, 32, 64)]
    curve = fit_curve(points, threads=1)
    assert curve.peak_tokens_per_s == pytest.approx(peak, rel=0.03)  # a log grid of 60 points a decade
    assert curve.half_saturation == pytest.approx(half, rel=0.03)


def test_the_simulator_interpolates_a_measured_curve():
    from lightning_fasync.simulate import ReplicaModel

    model = ReplicaModel(measured=[[2, 1000.0], [8, 4000.0], [64, 9000.0]])
    assert model.throughput(0) == 0.0
    assert model.throughput(1) == 500.0  # T(first) * c / first below the first point
    assert model.throughput(5) == 2500.0 and model.throughput(36) == 6500.0
    assert model.throughput(500) == 9000.0  # flat past the last point
    assert ReplicaModel(peak_tokens_per_s=100.0, half_saturation=1.0).throughput(1) == 50.0


def test_the_throughput_follows_the_longest_context_between_and_past_the_two_curves():
    from lightning_fasync.simulate import ReplicaModel

    model = ReplicaModel(measured=[[1, 100.0], [64, 6400.0]], measured_context=30.0,
                         measured_long=[[1, 50.0], [64, 1600.0]], measured_long_context=330.0)
    assert model.throughput(64) == model.throughput(64, 20.0) == 6400.0  # no context, or a short one
    assert model.throughput(64, 330.0) == pytest.approx(1600.0)
    # The time per token is linear in the context: halfway, the mean of 1/6400 and 1/1600.
    assert model.throughput(64, 180.0) == pytest.approx(1 / ((1 / 6400 + 1 / 1600) / 2))
    assert model.throughput(64, 630.0) == pytest.approx(1 / (2 / 1600 - 1 / 6400))  # past the long curve
    assert model.throughput(1, 330.0) == pytest.approx(50.0)
    flat = ReplicaModel(measured=[[1, 100.0], [64, 6400.0]])
    assert flat.throughput(64, 5000.0) == 6400.0  # not measured: no dependence


def test_a_long_response_slows_its_whole_batch_when_the_curve_says_so():
    """Groups of short responses, every fourth with one long response: with a long-context curve
    four times slower, the long response's batch mates decode at its context's cost and every mode's
    step is longer; with the long curve equal to the short one, nothing changes."""
    from lightning_fasync.config import load_config_file
    from lightning_fasync.simulate import SimConfig

    cfg, _ = load_config_file(DAPO, simulate=SimConfig)
    prof = _profile(cfg)
    groups = [[300 if g % 4 == 0 and i == 0 else 20 for i in range(cfg.N)] for g in range(48)]
    modes = [m for m in MODES if m[0] in ("colocate", "fully-async, in-flight updates")]

    def with_long(factor):
        engine = {k: dataclasses.replace(c, context=30.0, long_context=330.0,
                                         long_points=[(n, t / factor) for n, t in c.points])
                  for k, c in prof.engine.items()}
        return predict(cfg, dataclasses.replace(prof, engine=engine), steps=6, modes=modes, lengths=groups)

    plain = predict(cfg, prof, steps=6, modes=modes, lengths=groups)
    same, slow = with_long(1.0), with_long(4.0)
    for a, b in zip(plain, same):
        assert b["avg_step_excl0"] == pytest.approx(a["avg_step_excl0"], rel=1e-6)
    assert all(s["avg_step_excl0"] > 1.2 * p["avg_step_excl0"] for p, s in zip(plain, slow))


def test_the_trainer_fit_recovers_its_coefficients_and_stays_non_negative():
    calls, base, k = 4, 0.02, 0.5
    samples = [(t, calls * base + k * t / 1000) for t in (900, 1500, 2600, 4000, 700)]
    fit = fit_trainer(samples, calls, threads=1)
    assert fit.base_s == pytest.approx(base, rel=1e-6) and fit.s_per_ktoken == pytest.approx(k, rel=1e-6)
    flat = fit_trainer([(1000, 0.4), (1001, 0.6), (999, 0.5)], calls, threads=1)  # tokens do not vary: through 0
    assert flat.base_s == 0.0 and flat.s_per_ktoken == pytest.approx(0.5, rel=1e-2)


def test_a_profile_whose_steps_train_on_as_many_tokens_adds_steps_at_a_quarter_of_the_budget(monkeypatch):
    """The main job's first steps all answer at the budget: a fit through the origin would charge a
    policy that learns to answer shorter nothing for a training call's fixed cost. The profile then
    adds steps at a quarter of the budget and fits both; a run whose tokens vary gets none."""
    import lightning_fasync.plan as plan_module
    from lightning_fasync.lightning.cli import parse_fit_args

    fit = ["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml")]
    cfg, ns = parse_fit_args(fit)
    base, k, calls = 0.03, 0.04, cfg.minibatches_per_step
    seconds = lambda t: calls * base + k * t / 1000  # noqa: E731
    ran = []

    def fake_run(name, args, mode, steps, root, calls_, threads):
        budget = next((int(a.split("=")[1]) for a in args if a.startswith("--rollout.max_response_length=")),
                      cfg.rollout.max_response_length)
        ran.append((name, budget, steps))
        per = cfg.B * cfg.N * budget
        tokens = [per * (1 + i % 3) if name.startswith("fully-async") else per + i for i in range(steps - 1)]
        samples = [(t, seconds(t)) for t in tokens]
        return RunProfile(name, [1.0] * len(samples), fit_trainer(samples, calls_, threads), 0.01, 0.0, 0.0,
                          [[budget] * cfg.N])

    monkeypatch.setattr(plan_module, "_profile_run", fake_run)
    monkeypatch.setattr(plan_module, "_engine_curve", lambda *a, **kw: fit_curve([(1, 10.0), (4, 30.0), (16, 60.0)]))
    prof = plan_module.profile(fit, cfg, ns, steps=9)
    short = cfg.rollout.max_response_length // 4
    # colocate's tokens barely vary (under 15 % of their mean): it gets 4 more steps at a quarter of the budget.
    assert ran[:2] == [("colocate", cfg.rollout.max_response_length, 9), ("colocate-short", short, 4)]
    assert [r[0] for r in ran[2:]] == ["fully-async"]  # its tokens vary: its own fit separates the two costs
    col, fa = prof.colocate, prof.fully_async
    assert col.short_budget == short and fa.short_budget == 0 and len(col.trainer.samples) == 8 + 3
    for run in (col, fa):
        assert run.trainer.base_s == pytest.approx(base, rel=1e-6) and run.trainer.s_per_ktoken == pytest.approx(k, rel=1e-6)
    text = plan_module._profile_text(prof)
    assert f"fit over steps at response budgets {short} and the config's" in text


def test_a_simulate_config_is_planned_from_its_section_with_gpu_splits(tmp_path, capsys):
    assert main(["--config", DAPO, "--steps", "4", "--seeds", "1", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [r["config"] for r in plan["rows"]] == [name for name, _ in MODES]
    assert plan["rows"][0]["speedup_excl0"] == 1.0
    assert all(r["avg_step_excl0"] > 0 for r in plan["rows"])
    assert [s["config"] for s in plan["splits"]] == ["4:12", "8:8", "12:4"]
    assert "Recommended: " in text and "Trainer : rollout GPUs: " in text
    assert (tmp_path / "plan.md").read_text().strip() == text.strip()


def _profile(cfg) -> Profile:
    """A profile as the live runs would give it, made up (the CPU layout of a 2-core machine)."""
    run = lambda mode, threads, k: RunProfile(mode, [0.5] * 4, TrainerFit(threads, 0.01, k), 0.02, 0.005, 0.01,  # noqa: E731
                                             [[40] * cfg.N] * 16)
    curves = {2: fit_curve([(c, 3000 * c / (c + 4)) for c in (1, 4, 16, 64)], 2),
              1: fit_curve([(c, 2000 * c / (c + 4)) for c in (1, 4, 16, 64)], 1)}
    return Profile(2, run("colocate", 2, 0.1), run("fully-async", 1, 0.18), curves, 1, 64, 1)


def _colocate_rows(cfg, **engine_fields) -> list[dict]:
    """colocate and colocate + partial (over-dispatching B groups) predicted on a profile whose engine
    curves carry ``engine_fields``, on groups where every third has one 400-token response."""
    prof = _profile(cfg)
    engine = {k: dataclasses.replace(c, **engine_fields) for k, c in prof.engine.items()}
    groups = [[400 if g % 3 == 0 and i == 0 else 10 for i in range(cfg.N)] for g in range(48)]
    modes = [m for m in MODES if m[0] in ("colocate", "colocate + partial")]
    return predict(cfg, dataclasses.replace(prof, engine=engine), steps=8, modes=modes, lengths=groups, oversample=cfg.B)


def test_a_profile_predicts_every_mode_and_lengths_of_another_run_replace_its_own(tmp_path):
    from lightning_fasync.config import load_config_file
    from lightning_fasync.simulate import SimConfig

    cfg, _ = load_config_file(DAPO, simulate=SimConfig)  # any valid config: the profile's layout replaces its cluster
    prof = _profile(cfg)
    rows = predict(cfg, prof, steps=4)
    assert [r["config"] for r in rows] == [name for name, _ in MODES] and rows[0]["speedup_excl0"] == 1.0
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(json.dumps({"kind": "consume", "step": 0, "response_lengths": [400] * cfg.N}) + "\n"
                              for _ in range(20)))
    longer = predict(cfg, prof, steps=4, lengths=read_lengths([str(ledger)]))
    # Ten times the tokens: every mode's step is longer.
    assert all(b["avg_step_excl0"] > 2 * a["avg_step_excl0"] for a, b in zip(rows, longer))


def test_seeds_give_the_median_and_range_and_a_saved_profile_predicts_without_profiling(tmp_path, monkeypatch, capsys):
    """Each mode runs once per seed (the prompt order and the lengths drawn): on heavy-tailed groups
    the seeds' speedups differ, and the row holds their median and range. A plan.json's profile
    predicts again (other lengths, seeds) with no profile run."""
    import lightning_fasync.plan as plan_module
    from lightning_fasync.config import load_config_file
    from lightning_fasync.simulate import SimConfig

    cfg, _ = load_config_file(DAPO, simulate=SimConfig)
    prof = _profile(cfg)
    groups = [[300 if g % 5 == 0 else 8] * cfg.N for g in range(40)]
    modes = [m for m in MODES if m[0] in ("colocate", "fully-async, in-flight updates")]
    rows = predict(cfg, prof, steps=6, modes=modes, lengths=groups, seeds=4)
    assert rows[0]["speedup_excl0"] == rows[0]["speedup_excl0_min"] == rows[0]["speedup_excl0_max"] == 1.0
    fa = rows[1]
    assert fa["seeds"] == 4 and fa["speedup_excl0_min"] <= fa["speedup_excl0"] <= fa["speedup_excl0_max"]
    assert fa["speedup_excl0_min"] < fa["speedup_excl0_max"]  # the seeds drew other prompts
    seeds = [predict(cfg, prof, steps=6, modes=modes, lengths=groups, seed=k)[1]["speedup_excl0"] for k in range(4)]
    assert fa["speedup_excl0_min"] == min(seeds) and fa["speedup_excl0_max"] == max(seeds)

    saved = tmp_path / "earlier" / "plan.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps({"profile": dataclasses.asdict(prof)}))
    monkeypatch.setattr(plan_module, "profile", lambda *a, **k: pytest.fail("profiled again"))
    out = tmp_path / "again"
    fit_config = os.path.join(REPO, "configs", "tiny_cpu.yaml")
    assert main(["--config", fit_config, "--profile_from", str(saved), "--steps", "4", "--seeds", "2",
                 "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert [r["config"] for r in plan["rows"]] == [name for name, _ in MODES]
    assert plan["profile"] == json.loads(saved.read_text())["profile"]
    assert f"the profile of {saved}" in capsys.readouterr().out
    ledger = tmp_path / "ledger.jsonl"  # a whole earlier run whose answers shrink: replayed in its order
    ledger.write_text("".join(json.dumps({"kind": "consume", "step": g // 16, "response_lengths": [60 if g < 32 else 6] * 8})
                              + "\n" for g in range(64)))
    assert main(["--config", fit_config, "--profile_from", str(saved), "--steps", "4", "--seeds", "1",
                 "--lengths_from", str(ledger)]) == 0
    assert f"replayed in the order they were consumed from 64 groups of {ledger}" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="`--seeds` is 0; it must be >= 1"):
        main(["--config", fit_config, "--seeds", "0"])
    with pytest.raises(ConfigError, match="`--profile_from` is given while .* has a `simulate:` section"):
        main(["--config", DAPO, "--profile_from", str(saved)])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="`--profile_from` is .*bad.json.*, which is not a plan.json with a profile"):
        main(["--config", fit_config, "--profile_from", str(tmp_path / "bad.json")])


def test_oversample_sets_how_much_colocate_plus_partial_over_dispatches():
    """On long-tailed groups, over-dispatching B groups lets a colocate step end on the fastest half
    of them: the predicted colocate + partial step is shorter than with nothing over-dispatched."""
    from lightning_fasync.config import load_config_file
    from lightning_fasync.simulate import SimConfig

    cfg, _ = load_config_file(DAPO, simulate=SimConfig)
    prof = _profile(cfg)
    # An engine that never saturates (100 tokens/s per request at any concurrency): a step's rollout
    # lasts as long as its slowest group, so the tail is what over-dispatch can cut.
    prof = dataclasses.replace(prof, engine={k: fit_curve([(c, 100.0 * c) for c in (1, 4, 16, 64)], k) for k in prof.engine})
    groups = [[400 if g % 3 == 0 and i == 0 else 10 for i in range(cfg.N)] for g in range(48)]
    modes = [m for m in MODES if m[0] in ("colocate", "colocate + partial")]
    none = predict(cfg, prof, steps=8, modes=modes, lengths=groups, oversample=0)
    half = predict(cfg, prof, steps=8, modes=modes, lengths=groups, oversample=cfg.B)
    assert half[1]["avg_step_excl0"] < 0.8 * none[1]["avg_step_excl0"]
    with pytest.raises(ConfigError, match="`--oversample` is -1; it must be >= 0"):
        main(["--config", DAPO, "--oversample", "-1"])


def test_a_measured_prefill_rate_makes_resumed_requests_cost_what_they_prefill_again():
    """colocate + partial resumes its aborted long tail every step, each request prefilled again from
    its tokens so far: with the engine's prefill rate in the profile that costs time, so the row is
    slower than with prefill free, and the slower the prefill the slower the row; colocate, which
    resumes nothing, moves only by its prompts' prefill."""
    from lightning_fasync.config import load_config_file
    from lightning_fasync.simulate import SimConfig

    cfg, _ = load_config_file(DAPO, simulate=SimConfig)
    rows = lambda prefill: _colocate_rows(cfg, prefill_tokens_per_s=prefill)  # noqa: E731
    free, fast, slow = rows(0.0), rows(20000.0), rows(2000.0)
    assert free[1]["avg_step_excl0"] < fast[1]["avg_step_excl0"] < slow[1]["avg_step_excl0"]
    moved = lambda a, b, i: b[i]["avg_step_excl0"] / a[i]["avg_step_excl0"] - 1  # noqa: E731
    assert moved(free, slow, 1) > 2 * moved(free, slow, 0)  # partial pays for the tokens it resumes


def test_the_frozen_tail_pays_no_prefill_again_and_decodes_nothing_while_the_trainer_runs(monkeypatch):
    """colocate + partial with the tail frozen (weight_update_mode: inflight) against abort and
    resume (with the aborted requests' caches kept: no prefill again either, so faster than abort):
    with a slow prefill the frozen row is the faster one, restores nothing and still spans
    versions; and its replicas really stop during training: with a freeze that holds nothing (the
    tail decoding through training, which a colocate step must not do) the row would be faster."""
    from lightning_fasync.config import load_config_file
    from lightning_fasync.simulate import SimConfig, _SimRollout

    cfg, _ = load_config_file(DAPO, simulate=SimConfig)
    prof = _profile(cfg)
    engine = {k: dataclasses.replace(c, prefill_tokens_per_s=2000.0) for k, c in prof.engine.items()}
    prof = dataclasses.replace(prof, engine=engine)
    groups = [[400 if g % 3 == 0 and i == 0 else 10 for i in range(cfg.N)] for g in range(48)]
    modes = [m for m in MODES if m[0].startswith("colocate")]
    assert [m[0] for m in modes] == ["colocate", "colocate + partial", "colocate + partial, KV kept",
                                     "colocate + partial, tail frozen"]
    _, abort, kept, frozen = predict(cfg, prof, steps=8, modes=modes, lengths=groups, oversample=cfg.B)
    assert frozen["avg_step_excl0"] < abort["avg_step_excl0"]
    assert abort["partial_restored_count"] > 0 and frozen["partial_restored_count"] == 0
    assert frozen["partial_ratio"] > 0
    # Aborted and resumed from the caches they left: restored as abort's, with no prefill again.
    assert kept["avg_step_excl0"] < abort["avg_step_excl0"] and kept["partial_restored_count"] > 0
    monkeypatch.setattr(_SimRollout, "freeze_in_flight", lambda self, timeout: None)
    (_, _, _, leaky) = predict(cfg, prof, steps=8, modes=modes, lengths=groups, oversample=cfg.B)
    assert leaky["avg_step_excl0"] < frozen["avg_step_excl0"]


def test_a_prefill_holds_the_whole_replica_and_an_abort_counts_only_decoded_tokens():
    from lightning_fasync.simulate import ReplicaModel, _Replica, _Request
    from lightning_fasync.types import PromptId, PromptSample

    model = ReplicaModel(measured=[[1, 100.0], [64, 6400.0]], prefill_tokens_per_s=1000.0)
    replica = _Replica(model, 64)
    sample = PromptSample(PromptId(0, 0), [1] * 10, {})
    req = _Request(traj=None, sample=sample, target=150, base_len=90)  # 60 tokens to go, 100 inputs to prefill
    replica.admit(req)
    assert replica.next_finish_dt() == pytest.approx(100 / 1000.0 + 60 / 100.0)  # L / P, then 60 tokens at T(1)
    replica.advance(0.05)  # half the prefill: nothing decoded yet
    assert replica.abort_all() == [(req, 0)]
    req2 = _Request(traj=None, sample=sample, target=150, base_len=90)
    replica.admit(req2)
    replica.advance(0.1 + 0.2)  # the prefill, then 20 tokens
    ((_, decoded),) = replica.abort_all()
    assert decoded in (19, 20)  # int() of the progress, float rounding either side
    # A prefill holds the whole replica: a request admitted mid-decode stops the running one too.
    short = PromptSample(PromptId(0, 1), [1] * 10, {})
    first = _Request(traj=None, sample=short, target=60)
    replica.admit(first)
    replica.advance(0.01 + 0.3)  # its 10-token prefill, then 30 of its 60 tokens
    replica.admit(_Request(traj=None, sample=sample, target=150, base_len=90))  # 100 inputs: 0.1 s
    # 30 tokens to go at T(2) / 2 = 100 tokens/s each, after the newcomer's 0.1 s of prefill
    assert replica.next_finish_dt() == pytest.approx(0.1 + 30 / 100.0)


def test_each_admitted_request_costs_the_replica_its_fixed_time_again_when_resumed():
    """request_s (the engine's admission, round trip and result, which plan measures): every
    admission holds the whole replica that long besides its prefill, a resumed request's too, so
    colocate + partial, which dispatches more requests per consumed group, pays it more often."""
    from lightning_fasync.config import load_config_file
    from lightning_fasync.simulate import ReplicaModel, SimConfig, _Replica, _Request
    from lightning_fasync.types import PromptId, PromptSample

    sample = PromptSample(PromptId(0, 0), [1] * 10, {})
    plain = _Replica(ReplicaModel(measured=[[1, 100.0], [64, 6400.0]], prefill_tokens_per_s=1000.0), 64)
    costly = _Replica(ReplicaModel(measured=[[1, 100.0], [64, 6400.0]], prefill_tokens_per_s=1000.0, request_s=0.002), 64)
    for r in (plain, costly):
        for _ in range(4):
            r.admit(_Request(traj=None, sample=sample, target=50))
    # 4 prefills of 10 tokens, then 50 tokens at T(4) / 4 = 100 tokens/s each; plus 4 x 2 ms
    assert plain.next_finish_dt() == pytest.approx(0.04 + 0.5)
    assert costly.next_finish_dt() == pytest.approx(0.04 + 0.008 + 0.5)
    costly.advance(0.3)
    aborted = costly.abort_all()
    for req, done in aborted:
        costly.admit(_Request(traj=None, sample=sample, target=50, base_len=done))
    resumed = sum(done for _, done in aborted)
    # again 4 x 2 ms, and the prefill of the prompts and the tokens so far
    assert costly.next_finish_dt() == pytest.approx((40 + resumed) / 1000.0 + 0.008 + (50 - aborted[0][1]) / 100.0, rel=0.05)

    cfg, _ = load_config_file(DAPO, simulate=SimConfig)
    free, costly_rows = _colocate_rows(cfg, request_s=0.0), _colocate_rows(cfg, request_s=0.01)
    assert all(c["avg_step_excl0"] > f["avg_step_excl0"] for f, c in zip(free, costly_rows))
    assert costly_rows[1]["speedup_excl0"] < free[1]["speedup_excl0"]


def test_requests_admitted_together_share_one_prefill_batch_and_a_saturated_replica_pays_one_per_freed_slot():
    """prefill_batch_s (a forward pass's fixed cost, which plan measures from the engine's counters):
    the requests a replica admits before its clock moves share one batch; a request waiting for a
    slot is admitted in a batch of its own when one frees, as the engine does between decode steps,
    so over-dispatching past max_running_requests costs a batch per finish; a resumed request that
    adopts its kept cache runs no prefill and pays none."""
    from lightning_fasync.config import load_config_file
    from lightning_fasync.simulate import ReplicaModel, SimConfig, _Replica, _Request
    from lightning_fasync.types import PromptId, PromptSample

    sample = PromptSample(PromptId(0, 0), [1] * 10, {})
    curve = [[1, 100.0], [64, 6400.0]]
    plain = _Replica(ReplicaModel(measured=curve, prefill_tokens_per_s=1000.0), 64)
    batched = _Replica(ReplicaModel(measured=curve, prefill_tokens_per_s=1000.0, prefill_batch_s=0.005), 64)
    for r in (plain, batched):
        for _ in range(4):
            r.admit(_Request(traj=None, sample=sample, target=50))
    # 4 prefills of 10 tokens in one batch, then 50 tokens at T(4) / 4 = 100 tokens/s each
    assert plain.next_finish_dt() == pytest.approx(0.04 + 0.5)
    assert batched.next_finish_dt() == pytest.approx(0.04 + 0.005 + 0.5)

    def finish_all(replica: _Replica) -> float:
        t = 0.0
        while replica.num_running or replica.waiting:
            dt = replica.next_finish_dt()
            replica.advance(dt)
            t += dt
            replica.pop_finished()
        return t

    # One slot: each of 3 requests waits for the one before it, and is a batch of its own.
    one = _Replica(ReplicaModel(measured=curve, prefill_tokens_per_s=1000.0, prefill_batch_s=0.005), 1)
    for _ in range(3):
        one.admit(_Request(traj=None, sample=sample, target=10))
    assert finish_all(one) == pytest.approx(3 * (0.005 + 0.01 + 10 / 100.0))

    kept = _Replica(ReplicaModel(measured=curve, prefill_tokens_per_s=1000.0, prefill_batch_s=0.005), 64,
                    keep_resumed=True)
    kept.admit(_Request(traj=None, sample=sample, target=50, base_len=20))  # adopts its cache: no prefill
    assert kept.next_finish_dt() == pytest.approx(30 / 100.0)

    cfg, _ = load_config_file(DAPO, simulate=SimConfig)
    free, costly = _colocate_rows(cfg, prefill_batch_s=0.0), _colocate_rows(cfg, prefill_batch_s=0.5)
    assert all(c["avg_step_excl0"] > f["avg_step_excl0"] for f, c in zip(free, costly))
    assert costly[1]["speedup_excl0"] < free[1]["speedup_excl0"]


def test_a_prefill_batch_cost_is_solved_from_the_engines_counters():
    """64 lone requests (64 batches) against 3 batches of 64: ``seconds = batches * cost + requests *
    each`` recovers both; readings that cannot separate them (the batched requests admitted one by
    one too) give None, and a noisy negative solution reads 0."""
    cost, each = 0.0015, 0.0004
    reading = lambda batches, requests: (batches, requests, batches * cost + requests * each)  # noqa: E731
    assert batch_cost(reading(64, 64), reading(3, 192)) == pytest.approx(cost)
    assert batch_cost(reading(64, 64), reading(7, 192)) == pytest.approx(cost)  # arrivals split into more batches
    assert batch_cost(reading(64, 64), reading(192, 192)) is None
    assert batch_cost((64, 64, 0.02), (3, 192, 0.2)) == 0.0


def test_refusals_name_the_option(tmp_path):
    with pytest.raises(ConfigError, match="`--config` is 'nope.yaml', which does not exist"):
        main(["--config", "nope.yaml"])
    with pytest.raises(ConfigError, match="`--profile_steps` is 2"):
        main(["--config", DAPO, "--profile_steps", "2"])
    with pytest.raises(ConfigError, match="`--curve_repeats` is 0; it must be >= 1"):
        main(["--config", DAPO, "--curve_repeats", "0"])
    with pytest.raises(ConfigError, match="`--curve_repeats` is given while .*dapo_h20.yaml has a `simulate:` section; "
                                          "it sets how the engine is measured"):
        main(["--config", DAPO, "--curve_repeats", "2"])
    with pytest.raises(ConfigError, match="`--curve_repeats` is given while --profile_from is given"):
        main(["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"), "--profile_from", "x.json", "--curve_repeats", "2"])
    empty = tmp_path / "ledger.jsonl"
    empty.write_text(json.dumps({"kind": "checkpoint", "step": 0}) + "\n")
    with pytest.raises(ValueError, match="no consumed group with response_lengths"):
        read_lengths([str(empty)])


@pytest.mark.slow
def test_a_short_profile_of_the_main_job_predicts_every_mode(tmp_path):
    """The CLI end to end on the real config: two 4-step fits and the engine curves, then the table.
    (Its accuracy against the live tables is benchmarks/plan_accuracy.py's, not a test's.)"""
    out = tmp_path / "plan"
    proc = subprocess.run([sys.executable, "-m", "lightning_fasync.cli", "plan", "--config", "configs/tiny_cpu.yaml",
                           "--profile_steps", "3", "--curve_repeats", "1", "--steps", "6", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    plan = json.loads((out / "plan.json").read_text())
    prof = plan["profile"]
    assert prof["cores"] >= 1 and prof["colocate"]["trainer"]["s_per_ktoken"] > 0
    assert prof["fully_async"]["trainer"]["s_per_ktoken"] > 0
    assert all(curve["peak_tokens_per_s"] > 0 and len(curve["points"]) >= 3 for curve in prof["engine"].values())
    assert all(curve["prefill_tokens_per_s"] > 0 and curve["request_s"] > 0 and curve["repeats"] == 1
               for curve in prof["engine"].values())
    # A forward pass's fixed cost, from the engine's counters (batch_cost's own test checks the
    # solution; one noisy difference on a loaded machine may read 0).
    assert all(curve["prefill_batch_s"] >= 0 for curve in prof["engine"].values())
    # The curve again at a long context (3/4 of the main job's 65 + 64 tokens, less the 48 decoded).
    assert all(len(curve["long_points"]) == len(curve["points"]) and curve["long_context"] > curve["context"] > 0
               and all(t > 0 for _, t in curve["long_points"]) for curve in prof["engine"].values())
    assert "at context ~" in proc.stdout and "each the median of 1 difference)" in proc.stdout
    assert "prefill" in proc.stdout and "ms per request" in proc.stdout and "ms per prefill batch" in proc.stdout
    assert sum(len(g) for g in prof["colocate"]["lengths"]) == 4 * 16 * 8  # every consumed group of its 4 steps
    # A run whose steps all trained on about as many tokens took 3 more at a quarter of the budget (65 // 4).
    for key in ("colocate", "fully_async"):
        run = prof[key]
        assert run["short_budget"] in (0, 16)
        assert len(run["trainer"]["samples"]) == 3 + (2 if run["short_budget"] else 0)
    assert ("fit over steps at response budgets 16" in proc.stdout) == any(
        prof[key]["short_budget"] for key in ("colocate", "fully_async"))
    assert [r["config"] for r in plan["rows"]] == [name for name, _ in MODES]
    assert "Recommended: " in proc.stdout and "engine on" in proc.stdout

"""Config: spec names and defaults, and every forbidden combination refused in one sentence."""

import warnings

import pytest

from lightning_fasync.config import ConfigError, ConfigWarning, FasyncConfig, load_config, validate, with_overrides
from lightning_fasync.config import pipeline_capacity


def fully_async(**over):
    data = {
        "colocate": False,
        "fully_async": {"enable": True},
        "data_source": {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2},
        "trainer": {"mini_batch_size": 4},
    }
    for key, value in over.items():
        d = data
        parts = key.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return load_config(data)


def test_defaults_follow_the_spec():
    cfg = FasyncConfig()
    assert cfg.fully_async.enable is False
    assert cfg.fully_async.sliding_window == "no-window"
    assert cfg.fully_async.stale_steps == 0
    assert cfg.colocate is True
    assert cfg.run_mode == "default"
    assert cfg.data_source.num_prompts_per_step == 64
    assert cfg.trainer.mini_batch_size == 64
    assert (cfg.trainer.num_nodes, cfg.trainer.num_gpus_per_node) == (1, 8)
    assert cfg.rollout.sampler.num_oversample == 0
    assert cfg.rollout.partial is False
    assert cfg.rollout.mask_offpolicy_in_partial_rollout is False
    assert cfg.agentflow.router.max_connections == 512
    assert cfg.algorithm.m2po.enable is False and cfg.algorithm.opsm.enable is False
    assert cfg.sources == [cfg.data_source]
    validate(cfg)


@pytest.mark.parametrize(
    "B,stale,expected", [(64, 1.0, 128), (64, 0, 64), (64, 2.0, 192), (10, 0.25, 12), (3, 0.5, 4), (7, 0.1, 7)]
)
def test_capacity_is_int_of_b_times_one_plus_stale(B, stale, expected):
    assert pipeline_capacity(B, stale) == expected == int(B * (1 + stale))


@pytest.mark.parametrize(
    "over,key,fragment",
    [
        ({"colocate": True}, "`colocate`", "colocate: false"),
        ({"run_mode": "train-only"}, "`run_mode`", "only the default mode"),
        ({"run_mode": "rollout-only"}, "`run_mode`", "only the default mode"),
        ({"trainer.mini_batch_size": 3}, "`trainer.mini_batch_size`", "divisible"),
        ({"fully_async.stale_steps": -0.5}, "`fully_async.stale_steps`", ">= 0"),
        ({"rollout.sampler.num_oversample": 2}, "`rollout.sampler.num_oversample`", "must be 0"),
        ({"rollout.mask_offpolicy_in_partial_rollout": True}, "`rollout.mask_offpolicy_in_partial_rollout`", "partial"),
        (
            {"algorithm.m2po.enable": True, "trainer.use_rollout_log_probs": True},
            "`algorithm.m2po.enable`",
            "use_rollout_log_probs",
        ),
        ({"fully_async.sliding_window": "fifo"}, "`fully_async.sliding_window`", "windowed-fifo"),
        ({"rollout.weight_update_mode": "sometimes"}, "`rollout.weight_update_mode`", "wait, abort, inflight, auto"),
        ({"rollout.weight_update_mode": "inflight"}, "`rollout.weight_update_mode`", "needs partial: true"),
        ({"rollout.partial": True, "rollout.weight_update_mode": "wait"}, "`rollout.weight_update_mode`",
         "partial: false"),
        ({"rollout.partial": True, "rollout.inflight_kv": "recompute"}, "`rollout.inflight_kv`", "in-flight updates only"),
        ({"rollout.partial": True, "rollout.weight_update_mode": "inflight", "rollout.inflight_kv": "rebuild"},
         "`rollout.inflight_kv`", "keep or recompute"),
        ({"rollout.sampling_seed": -1}, "`rollout.sampling_seed`", "non-negative integer"),
        ({"rollout.deterministic_inference": True, "rollout.backend": "vllm"}, "`rollout.deterministic_inference`",
         "start your servers deterministic yourself"),
        ({"rollout.engine_device": "gpu"}, "`rollout.engine_device`", "cpu, cuda or cuda:N"),
        ({"rollout.engine_device": "cuda", "rollout.backend": "external", "rollout.engine_urls": ["http://127.0.0.1:1"]},
         "`rollout.engine_device`", "embedded engine only"),
        # This machine's CUDA devices, counted by torch: none on a CPU machine, so cuda:99 anywhere.
        ({"rollout.engine_device": "cuda:99"}, "`rollout.engine_device`", "CUDA device(s)"),
    ],
)
def test_forbidden_combinations_are_refused(over, key, fragment):
    cfg = fully_async(**over)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    msg = str(info.value)
    assert key in msg and fragment in msg
    assert msg.count(". ") <= 1 and "\n" not in msg  # one sentence


def test_more_than_one_data_source_refused_in_every_mode():
    cfg = fully_async()
    src = {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2}
    cfg2 = load_config({**cfg.to_dict(), "data_sources": [src, src]})
    with pytest.raises(ConfigError, match="`data_sources` lists 2 sources"):
        validate(cfg2)
    cfg2.fully_async.enable = False
    cfg2.colocate = True
    with pytest.raises(ConfigError, match="`data_sources` lists 2 sources"):
        validate(cfg2)  # nothing would read the second one
    cfg2.data_sources = [cfg2.data_sources[0]]
    validate(cfg2)


@pytest.mark.parametrize("mode", ["train-only", "rollout-only"])
def test_run_modes_other_than_default_are_refused(mode):
    for cfg in (fully_async(run_mode=mode), load_config({"run_mode": mode})):
        with pytest.raises(ConfigError, match=f"`run_mode` is '{mode}'; lightning-fasync runs only the default mode"):
            validate(cfg)


def test_mini_batch_not_multiple_of_n_warns():
    cfg = fully_async(**{"data_source.num_trajectories_per_prompt": 4, "data_source.num_prompts_per_step": 3, "trainer.mini_batch_size": 6})
    with pytest.warns(ConfigWarning, match="M % N == 0"):
        validate(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(fully_async())


def test_partial_with_mask_is_allowed_and_colocate_baseline_is_valid():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # allowed: neither refused nor warned about
        partial = validate(fully_async(**{"rollout.partial": True, "rollout.mask_offpolicy_in_partial_rollout": True}))
        colocate = validate(load_config({"colocate": True, "rollout": {"sampler": {"num_oversample": 8}}}))
    assert partial.fully_async.enable and partial.rollout.partial and partial.rollout.mask_offpolicy_in_partial_rollout
    assert colocate.colocate and not colocate.fully_async.enable and colocate.rollout.sampler.num_oversample == 8


def test_unknown_and_mistyped_keys_name_the_key():
    with pytest.raises(ConfigError, match=r"`fully_async.stale` is not a configuration key"):
        load_config({"fully_async": {"stale": 1}})
    with pytest.raises(ConfigError, match=r"`rollout.partial` must be true or false"):
        load_config({"rollout": {"partial": "maybe"}})
    with pytest.raises(ConfigError, match=r"`nope` is not a configuration key"):
        load_config({"nope": 1})
    with pytest.raises(ConfigError, match=r"`fully_async.stale_steps` must be a number"):
        load_config({"fully_async": {"stale_steps": "one"}})


def test_plugins_must_import():
    cfg = fully_async(**{"fully_async.plugins": ["no_such_module_xyz"]})
    with pytest.raises(ConfigError, match="`fully_async.plugins` lists 'no_such_module_xyz'"):
        validate(cfg)


def test_colocate_reads_auto_as_abort_and_inflight_as_the_frozen_tail():
    auto = load_config({"rollout": {"partial": True, "weight_update_mode": "auto"}})
    validate(auto)
    assert auto.rollout.boundary_mode == "inflight" and auto.boundary_mode == "abort"
    frozen = load_config({"rollout": {"partial": True, "weight_update_mode": "inflight"}})
    validate(frozen)
    assert frozen.boundary_mode == "inflight"
    # Offloading hands the KV cache the frozen requests hold to the trainer.
    offload = load_config({"rollout": {"partial": True, "weight_update_mode": "inflight"}, "colocate_offload": True})
    with pytest.raises(ConfigError, match="`colocate_offload` is true while `rollout.weight_update_mode` is inflight"):
        validate(offload)
    recompute = load_config({"rollout": {"partial": True, "weight_update_mode": "auto", "inflight_kv": "recompute"}})
    with pytest.raises(ConfigError, match="`rollout.inflight_kv` is recompute while `fully_async.enable` is false"):
        validate(recompute)


@pytest.mark.parametrize("partial,mode,effective", [(False, None, "wait"), (True, None, "abort"),
                                                    (True, "inflight", "inflight"), (True, "abort", "abort")])
def test_the_boundary_mode_reads_partial_when_unset(partial, mode, effective):
    cfg = fully_async(**{"rollout.partial": partial, "rollout.weight_update_mode": mode})
    validate(cfg)
    assert cfg.rollout.boundary_mode == effective


@pytest.mark.parametrize("backend,weight_sync,effective", [("embedded", "auto", "inflight"), ("vllm", "auto", "inflight"),
                                                           ("vllm", "adapter", "abort"), ("sglang", "auto", "abort"),
                                                           ("external", "auto", "abort")])
def test_auto_reads_inflight_where_the_engine_was_tested_with_it(backend, weight_sync, effective):
    """``auto``: in-flight on the embedded engine and vLLM (run against both), the spec's abort on
    SGLang (never run against the real one), servers someone else runs, and vLLM's adapter path."""
    cfg = fully_async(**{"rollout.partial": True, "rollout.weight_update_mode": "auto", "rollout.backend": backend,
                         "rollout.weight_sync": weight_sync})
    assert cfg.rollout.boundary_mode == effective and cfg.boundary_mode == effective


@pytest.mark.parametrize("over,effective", [
    ({}, "inflight"),
    ({"colocate": True, "fully_async.enable": False}, "abort"),  # colocate + partial
    ({"colocate": True, "fully_async.enable": False, "rollout.partial": False}, "wait"),  # colocate
    ({"rollout.partial": False}, "wait"),  # fully-async, boundary waits
])
def test_the_shipped_configs_take_the_baselines_overrides(over, effective):
    """The long-tailed workload sets ``weight_update_mode: auto``; the overrides the colocate
    baselines and the boundary-waits run apply to it need nothing else."""
    import os

    import yaml

    from lightning_fasync.config.schema import TrainerConfig

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "configs", "tiny_cpu_longtail.yaml")) as f:
        data = yaml.safe_load(f)
    assert data["rollout"]["weight_update_mode"] == "auto"
    plugin = {k: v for k, v in data.items() if k in {"colocate", "fully_async", "data_source", "rollout", "algorithm"}}
    plugin["trainer"] = {k: v for k, v in data["trainer"].items() if k in TrainerConfig.__dataclass_fields__}
    cfg = validate(with_overrides(load_config(plugin), over))
    assert cfg.boundary_mode == effective, over


def test_recompute_is_refused_where_nothing_stays_in_flight():
    cfg = load_config({"rollout": {"partial": True, "weight_update_mode": "auto", "inflight_kv": "recompute"}})
    with pytest.raises(ConfigError, match="`rollout.inflight_kv` is recompute while `fully_async.enable` is false"):
        validate(cfg)
    cfg = fully_async(**{"rollout.partial": False, "rollout.weight_update_mode": "auto", "rollout.inflight_kv": "recompute"})
    with pytest.raises(ConfigError, match=r"`rollout.weight_update_mode` is auto \(here wait\)"):
        validate(cfg)


def test_resume_kv_keep_needs_partial_rollout_and_the_embedded_engine():
    keep = fully_async(**{"rollout.partial": True, "rollout.resume_kv": "keep"})
    validate(keep)
    assert load_config({}).rollout.resume_kv == "recompute"
    with pytest.raises(ConfigError, match="`rollout.resume_kv` is 'later'; it must be recompute or keep"):
        validate(fully_async(**{"rollout.resume_kv": "later"}))
    with pytest.raises(ConfigError, match="`rollout.resume_kv` is keep while `rollout.partial` is false"):
        validate(fully_async(**{"rollout.partial": False, "rollout.resume_kv": "keep"}))
    with pytest.raises(ConfigError, match="`rollout.resume_kv` is keep while `rollout.backend` is vllm; .*embedded"):
        validate(fully_async(**{"rollout.partial": True, "rollout.resume_kv": "keep", "rollout.backend": "vllm"}))


@pytest.mark.parametrize("key,value", [("format", "parquet"), ("prompt_key", "question"), ("answer_key", "answer"),
                                       ("system_prompt", "Be brief."), ("max_prompt_length", 100)])
def test_a_files_only_key_without_a_path_is_refused_for_training_and_eval_sources(key, value):
    with pytest.raises(ConfigError, match=rf"`data_source.{key}` is {value!r} but `data_source.path` is not set; it "
                                          "applies only to prompts read from files"):
        validate(fully_async(**{f"data_source.{key}": value}))
    with pytest.raises(ConfigError, match=rf"`eval.data_source\[0\].{key}` is {value!r} but "
                                          r"`eval.data_source\[0\].path` is not set"):
        validate(fully_async(**{"eval.data_source": [{"name": "held", key: value}]}))
    # With files it is what it is for.
    validate(fully_async(**{"data_source.path": "prompts.jsonl", f"data_source.{key}": value,
                            "data_source.reward": "lightning_fasync.data.rewards:math_reward"}))


@pytest.mark.parametrize("key", ["num_prompts_per_step", "num_trajectories_per_prompt"])
def test_an_eval_set_with_steps_or_groups_of_its_own_is_refused(key):
    with pytest.raises(ConfigError, match=rf"`eval.data_source\[0\].{key}` is 3; an eval set has no steps or groups "
                                          r"of its own: it scores its first `num_prompts` prompts with `eval.sampling.n`"):
        validate(fully_async(**{"eval.data_source": [{"name": "held", key: 3}]}))


def test_a_data_source_that_disagrees_with_data_sources_is_refused():
    src = {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2}
    # data_source as the config gives it and data_sources with the same source: nothing is lost.
    validate(load_config({**fully_async().to_dict(), "data_sources": [src]}))
    # data_source left at its defaults: data_sources alone gives the source.
    only = fully_async().to_dict()
    only.pop("data_source")
    validate(load_config({**only, "data_sources": [src]}))
    with pytest.raises(ConfigError, match=r"`data_source.seed` is 7 but `data_sources\[0\].seed` is 1234; "
                                          r"`data_sources` replaces `data_source`"):
        validate(load_config({**fully_async(**{"data_source.seed": 7}).to_dict(), "data_sources": [src]}))

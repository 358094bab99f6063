"""The registries (lightning_fasync.registry): built-ins imported on first use, names checked by
the config with one sentence, entries of your own registered, looked up and refused on a clash."""

import subprocess
import sys

import pytest

from lightning_fasync.config import ConfigError, load_config, validate
from lightning_fasync.registry import (
    ENGINE_BACKENDS,
    TRAINERS,
    WEIGHT_PATHS,
    WINDOWS,
    Registry,
    WeightPath,
    trainer_backend_named,
    weight_sync_choices,
)
from tests.helpers.paths import REPO


def test_builtins_are_named_by_path_and_imported_on_first_use():
    code = ("import sys; from lightning_fasync import registry; from lightning_fasync.config import load_config, validate; "
            "validate(load_config({})); print('lightning_fasync.fleet.backends' in sys.modules, "
            "'lightning_fasync.weights.group' in sys.modules, 'lightning_fasync.trainers.megatron' in sys.modules); "
            "registry.WEIGHT_PATHS.get('distributed'); print('lightning_fasync.weights.group' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    # The default config's backend is checked through its record (imported); the distributed path and
    # Megatron are not imported until something asks for them.
    assert out.stdout.split() == ["True", "False", "False", "True"]


def test_the_built_in_names_in_their_order():
    assert ENGINE_BACKENDS.names() == ["embedded", "sglang", "vllm", "external"]
    assert weight_sync_choices() == ["auto", "distributed", "tensor", "disk", "vllm", "adapter"]
    assert WINDOWS.names()[:3] == ["no-window", "window-gated", "windowed-fifo"]
    assert {"fsdp2", "megatron"} <= set(TRAINERS.names())
    assert ENGINE_BACKENDS.get("embedded").supervised and not ENGINE_BACKENDS.get("external").supervised
    assert ENGINE_BACKENDS.get("vllm").supervised
    assert WEIGHT_PATHS.get("disk").client_method == "update_weights_from_disk"


@pytest.mark.parametrize("data, sentence", [
    ({"rollout": {"backend": "trtllm"}}, "`rollout.backend` is 'trtllm', which is not a registered engine backend; it must be one of embedded, sglang, vllm, external"),
    ({"rollout": {"weight_sync": "nccl"}}, "`rollout.weight_sync` is 'nccl'; it must be one of auto, distributed, tensor, disk, vllm"),
    ({"fully_async": {"sliding_window": "fifo"}}, "`fully_async.sliding_window` is 'fifo', which is not a registered sliding-window strategy"),
])
def test_a_name_not_registered_is_refused_naming_the_key_and_the_names(data, sentence):
    with pytest.raises(ConfigError) as err:
        validate(load_config(data))
    assert sentence in str(err.value)


def test_an_entry_of_your_own_is_registered_looked_up_and_refused_on_a_clash():
    reg = Registry("rollout.thing", "thing", {"built": "lightning_fasync.registry:WINDOWS"})
    assert reg.get("built") is WINDOWS  # imported from its path
    mine = object()
    assert reg.register("mine", mine) is mine and reg.get("mine") is mine
    assert reg.names() == ["built", "mine"] and "mine" in reg

    @reg.register("decorated")
    class Decorated:
        pass

    assert reg.get("decorated") is Decorated
    with pytest.raises(ValueError, match="named 'mine' is already registered"):
        reg.register("mine", object())
    with pytest.raises(ValueError, match="named 'built' is already registered"):
        reg.register("built", object())
    other = object()
    reg.register("built", other, replace=True)
    assert reg.get("built") is other
    with pytest.raises(ConfigError, match="`rollout.thing` is 'nope', which is not a registered thing"):
        reg.get("nope")


def test_a_registered_weight_path_is_a_valid_rollout_weight_sync_and_its_check_runs():
    def refuse_big_buckets(cfg):
        if cfg.rollout.weight_sync_bucket_mb > 4096:
            raise ConfigError("`rollout.weight_sync_bucket_mb` is over 4096 under the test path.")

    WEIGHT_PATHS.register("test-path", WeightPath(name="test-path", make=object, client_method="update_weights_from_tensor",
                                                  check_config=refuse_big_buckets))
    try:
        cfg = validate(load_config({"rollout": {"weight_sync": "test-path"}}))
        assert cfg.rollout.weight_sync == "test-path" and "test-path" in weight_sync_choices()
        with pytest.raises(ConfigError, match="over 4096 under the test path"):
            validate(load_config({"rollout": {"weight_sync": "test-path", "weight_sync_bucket_mb": 8192}}))
    finally:
        WEIGHT_PATHS.unregister("test-path")


def test_trainer_backends_are_found_by_command_line_name():
    assert trainer_backend_named("MegatronStrategy").name == "megatron"
    assert trainer_backend_named("model_parallel").name == "fsdp2"
    assert trainer_backend_named("ddp") is None and trainer_backend_named(None) is None
    assert TRAINERS.get("megatron").module_class == "lightning_fasync.trainers.megatron.module:MegatronPolicyModule"

"""What leaves the trainer with ``model.lora``: the merged view against peft's own ``merge_and_unload``,
and the adapter path (``rollout.weight_sync: adapter``) against the embedded engine's
``/load_lora_adapter`` in process: the adapter push serves the merged push's log-probs, paths
outside the engine's LoRA directory are refused, the adapter survives a full weight update, and a
kept push gives a restarted engine what it must hold."""

import copy
import os

import pytest
import torch

from lightning_fasync.config import ConfigError, load_config, validate
from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.lora import AdapterWeights, write_adapter_dir
from lightning_fasync.policy import build_policy
from lightning_fasync.weights.checksum import checksums, compare
from lightning_fasync.weights.lora_sync import AdapterKept, AdapterWeightSync
from lightning_fasync.weights.sync import push_kept
from tests.helpers.engine import call, serve

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj", "lm_head"]}  # tiny's lm_head is not tied
PROMPTS = [[1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63, 64]]


def trained(sync="merged", seed=0):
    module = RLPolicyModule("tiny", lora={**LORA, "sync": sync})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_" in name:  # A is peft's random init, B its zeros: both set here, from one seed
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if "lora_B" in name else 0.2))
    return module


def test_the_merged_push_is_peft_merge_and_unload_and_leaves_the_trained_weights_unchanged():
    module = trained()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    merged = module.engine_state_dict()
    reference = copy.deepcopy(module.policy).merge_and_unload().state_dict()
    assert list(merged) == list(reference)  # the plain HF names, in order: no base_model.model., no lora_
    assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model.") for k in merged)
    for name, tensor in reference.items():
        assert torch.equal(merged[name], tensor), name
    assert any(not torch.equal(merged[n], t) for n, t in build_policy("tiny")[0].state_dict().items())
    assert all(torch.equal(p, before[n]) for n, p in module.policy.named_parameters())


def greedy(session, url, lora_path=None):
    async def run():
        out = []
        for ids in PROMPTS:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}, "return_logprob": True}
            if lora_path is not None:
                body["lora_path"] = lora_path
            status, answer = await call(session, "POST", url + "/generate", body)
            assert status == 200, answer
            out.append(answer["meta_info"]["output_token_logprobs"])
        return out

    return run()


def test_the_adapter_push_serves_the_merged_pushs_log_probs():
    merged_module, adapter_module = trained("merged"), trained("adapter")
    results = {}

    async def merged_body(session, url, engine):
        client = SGLangClient([url])
        try:
            await client.update_weights_from_tensor(merged_module.engine_state_dict(), weight_version=1)
        finally:
            await client.close()
        results["merged"] = await greedy(session, url)

    async def adapter_body(session, url, engine):
        client = SGLangClient([url])
        try:
            weights = adapter_module.engine_state_dict()
            assert isinstance(weights, AdapterWeights) and all(".lora_" in k for k in weights)
            await client.update_lora_adapter(weights, weight_version=1)
            _, info = await call(session, "GET", url + "/get_weight_version")
            assert info["weight_version"] == "1"
            results["adapter"] = await greedy(session, url, lora_path="policy")
            results["unnamed"] = await greedy(session, url)  # served with the merged adapter too
            # A second push replaces the adapter under the same name.
            await client.update_lora_adapter(weights, weight_version=2)
        finally:
            await client.close()

    policy = build_policy("tiny")
    serve(policy, merged_body, own_model=True)
    serve(policy, adapter_body, own_model=True)

    async def base_body(session, url, engine):
        results["base"] = await greedy(session, url)

    serve(policy, base_body, own_model=True)
    for got, want in zip(results["adapter"], results["merged"]):
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert max(abs(a - b) for (a, _, _), (b, _, _) in zip(got, want)) < 1e-5
    assert results["unnamed"] == results["adapter"]
    assert results["base"] != results["merged"]  # the adapter changes what is served


def test_an_adapter_path_outside_the_engines_lora_dir_is_refused(tmp_path):
    module = trained("adapter")
    weights = module.engine_state_dict()
    outside = write_adapter_dir(dict(weights), weights.config, str(tmp_path / "outside"))

    async def body(session, url, engine):
        _, info = await call(session, "GET", url + "/server_info")
        root = info["lora_dir"]
        assert os.path.isdir(root) and (os.stat(root).st_mode & 0o077) == 0  # private to this user
        inside_link = os.path.join(root, "escape")
        os.symlink(outside, inside_link)
        for path in (outside, inside_link, os.path.join(root, "..", os.path.basename(outside)), root):
            status, answer = await call(session, "POST", url + "/load_lora_adapter", {"lora_name": "x", "lora_path": path})
            assert status == 400 and answer["success"] is False, path
            assert "outside the engine's LoRA directory" in answer["error_message"], answer
            assert answer["loaded_adapters"] == {}
        status, answer = await call(session, "POST", url + "/generate",
                                    {"input_ids": [1, 40], "sampling_params": {"max_new_tokens": 1}, "lora_path": "x"})
        assert status == 400 and "is not loaded" in answer["error"]["message"]
        status, answer = await call(session, "POST", url + "/unload_lora_adapter", {"lora_name": "x"})
        assert status == 400 and answer["success"] is False

    serve(build_policy("tiny"), body, own_model=True)


def test_without_lora_the_engine_refuses_as_sglang_does(tmp_path):
    async def body(session, url, engine):
        status, answer = await call(session, "POST", url + "/load_lora_adapter", {"lora_name": "x", "lora_path": "/"})
        assert status == 400 and answer["error_message"] == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        _, info = await call(session, "GET", url + "/server_info")
        assert info["enable_lora"] is False and info["lora_dir"] is None

    serve(build_policy("tiny"), body, app_kwargs={"enable_lora": False}, own_model=True)


def test_the_adapter_stays_merged_over_a_full_weight_update_and_unloads_to_the_new_base():
    module = trained("adapter")
    weights = module.engine_state_dict()
    new_base = build_policy("tiny")[0]
    with torch.no_grad():
        for p in new_base.parameters():
            p.mul_(0.9)
    # What the engine must hold: peft's own merge of the same adapter onto the new base.
    from peft import set_peft_model_state_dict

    from lightning_fasync.lora import apply_lora, as_lora_config

    on_new = apply_lora(copy.deepcopy(new_base), as_lora_config(LORA))
    set_peft_model_state_dict(on_new, {k: v.clone() for k, v in weights.items()})
    expected = on_new.merge_and_unload().state_dict()

    async def body(session, url, engine):
        client = SGLangClient([url])
        try:
            await client.update_lora_adapter(weights, weight_version=1)
            await client.update_weights_from_tensor(new_base.state_dict(), weight_version=2)
            served = dict(engine.model.named_parameters())
            for name, tensor in served.items():
                torch.testing.assert_close(tensor, expected[name], rtol=0, atol=2e-6, msg=name)
            await client.unload_lora_adapter("policy")
            served = dict(engine.model.named_parameters())
            for name, tensor in new_base.state_dict().items():
                assert torch.equal(served[name], tensor), name
        finally:
            await client.close()

    serve(build_policy("tiny"), body, own_model=True)


def test_a_kept_adapter_push_gives_a_restarted_engine_the_weights_it_checks(tmp_path):
    module = trained("adapter")
    weights = module.engine_state_dict()
    kept = {}

    async def first(session, url, engine):
        sync = AdapterWeightSync(SGLangClient([url]), keep=True, pause_mode="abort", work_dir=str(tmp_path))
        try:
            kept["weights"] = await sync.push(weights, 5)
        finally:
            await sync.close()

    serve(build_policy("tiny"), first, own_model=True)
    adapter_kept = kept["weights"]
    assert isinstance(adapter_kept, AdapterKept) and os.path.isfile(os.path.join(adapter_kept.path, "adapter_config.json"))
    expected = checksums(adapter_kept.named_tensors())

    async def restarted(session, url, engine):
        client = SGLangClient([url])
        try:
            await push_kept(adapter_kept, client)
            (reported,) = await client.weight_checksums()
            assert compare(expected, reported) == []
            _, info = await call(session, "GET", url + "/get_weight_version")
            assert info["weight_version"] == "5"
        finally:
            await client.close()

    serve(build_policy("tiny"), restarted, own_model=True)
    adapter_kept.release()
    assert not os.path.exists(tmp_path / os.path.basename(adapter_kept.path or "gone"))


def test_full_weights_over_the_adapter_path_are_refused():
    module = trained("merged")

    async def body(session, url, engine):
        sync = AdapterWeightSync(SGLangClient([url]), pause_mode=None)
        try:
            with pytest.raises(ValueError, match="model.lora.sync: adapter"):
                await sync.push(module.engine_state_dict(), 1)
        finally:
            await sync.close()

    serve(build_policy("tiny"), body, own_model=True)


def test_the_config_refuses_what_the_adapter_path_cannot_run():
    with pytest.raises(ConfigError, match="`rollout.weight_sync` is adapter while `rollout.backend` is external"):
        validate(load_config({"rollout": {"weight_sync": "adapter", "backend": "external",
                                          "engine_urls": ["http://h:1"]}}))
    for backend in ("vllm", "sglang"):  # the plugin starts them with their LoRA serving
        validate(load_config({"rollout": {"weight_sync": "adapter", "backend": backend}}))
    cfg = load_config({"rollout": {"weight_sync": "adapter"}})
    validate(cfg)
    with pytest.raises(ConfigError, match="`rollout.weight_sync` is adapter while `model.lora` is not set"):
        RLPolicyModule("tiny").check_fasync_config(cfg)
    with pytest.raises(ConfigError, match="`rollout.weight_sync` is adapter while `model.lora.sync` is merged"):
        trained("merged").check_fasync_config(cfg)
    trained("adapter").check_fasync_config(cfg)
    with pytest.raises(ConfigError, match="`model.lora.sync` is adapter while `rollout.weight_sync` is auto"):
        trained("adapter").check_fasync_config(load_config({}))


def test_the_engines_merge_is_peft_merge_and_the_same_bits_at_any_thread_count():
    """The engine's merge of a loaded adapter against peft's merge_and_unload, and its bits at 1 and 2
    torch threads: the trainer recomputes them for a restarted replica's checksum check."""
    from lightning_fasync.lora import adapter_deltas, merge_weight

    module = trained("adapter")
    weights = module.engine_state_dict()
    deltas = adapter_deltas(weights.config, dict(weights))
    reference = copy.deepcopy(module.policy).merge_and_unload().state_dict()
    # A delta for every targeted weight (each layer's projections and lm_head), so the loop checks them all.
    targeted = {n for n in reference if n.endswith(".weight") and n.rsplit(".", 2)[-2] in LORA["target_modules"]}
    assert deltas and set(deltas) == targeted
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append({name: merge_weight(weights.base[name], d) for name, d in deltas.items()})
    finally:
        torch.set_num_threads(threads)
    for name in deltas:
        assert torch.equal(runs[0][name], runs[1][name]), name
        torch.testing.assert_close(runs[0][name], reference[name], rtol=0, atol=1e-6, msg=name)

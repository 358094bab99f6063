"""``rollout.backend: vllm`` without a vLLM server: its answers parsed into the pipeline's results
(per-token versions from vLLM's spans), the refusals before anything starts, the server's command
line and environment, and the registry entries. ``tests/integration/test_vllm*.py`` run the real server."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from lightning_fasync.config import ConfigError, VLLMArgs, load_config, validate
from lightning_fasync.fleet.vllm import CPU_HEAD_SIZES, VLLMPlan, VLLMPool, parse_vllm_response, prepare_vllm
from lightning_fasync.pipeline.engine_client import EngineError, GenerateRequest, SamplingParams
from lightning_fasync.registry import ENGINE_BACKENDS, WEIGHT_PATHS
from lightning_fasync.weights.sync import resolve_weight_sync


def answer(tokens, spans, reason="length", logprobs=None):
    return {"usage": {"prompt_tokens": 5}, "choices": [{
        "finish_reason": reason, "token_ids": tokens, "weight_versions": spans,
        "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, logprobs or [-0.5] * len(tokens))]},
    }]}


def test_a_vllm_answer_gives_one_version_per_token_from_its_spans():
    r = parse_vllm_response("r", answer([7, 8, 9], [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
                                        logprobs=[-1.0, -2.0, -3.0]))
    assert (r.output_ids, r.weight_versions, r.output_log_probs, r.prompt_tokens) == ([7, 8, 9], [3, 3, 4], [-1.0, -2.0, -3.0], 5)
    # The initial label is vLLM's (and SGLang's) "default", version 0; an aborted answer keeps its tokens.
    r = parse_vllm_response("r", answer([5], [{"version": "default", "start": 0, "end": 1}], reason="abort"))
    assert (r.finish_reason, r.weight_versions) == ("abort", [0])
    assert parse_vllm_response("r", answer([], [], reason="abort")).output_ids == []


@pytest.mark.parametrize("data, match", [
    (answer([7, 8], [{"version": "1", "start": 0, "end": 1}]), "cover 1 of 2"),
    (answer([7, 8], None), "labelled none"),
    (answer([7], [{"version": "1", "start": 0, "end": 1}], reason="error"), "unexpected finish_reason"),
    ({"choices": []}, "0 choices"),
])
def test_a_vllm_answer_that_does_not_account_for_its_tokens_is_refused(data, match):
    with pytest.raises(EngineError, match=match):
        parse_vllm_response("r", data)


def test_log_probs_must_be_the_sampled_tokens():
    data = answer([7, 8], [{"version": "1", "start": 0, "end": 2}])
    data["choices"][0]["logprobs"]["content"][1]["token_id"] = 9
    with pytest.raises(EngineError, match="token 8 was sampled"):
        parse_vllm_response("r", data)


def cfg(**rollout):
    return load_config({"rollout": {"backend": "vllm", **rollout}})


def test_the_vllm_backend_and_weight_path_are_registered_and_auto_picks_vllms_api():
    assert "vllm" in ENGINE_BACKENDS.names() and "vllm" in WEIGHT_PATHS.names()
    assert resolve_weight_sync(validate(cfg())) == "vllm"


@pytest.mark.parametrize("rollout, match", [
    ({"weight_sync": "tensor"}, r"`rollout.weight_sync` is tensor while `rollout.backend` is vllm"),
    ({"vllm_args": {"extra": ["--port", "9"]}}, r"`rollout.vllm_args.extra` sets --port"),
    ({"vllm_args": {"weight_transfer": "nccl"}}, r"`rollout.vllm_args.weight_transfer` is 'nccl'"),
    ({"vllm_args": {"dtype": "int8"}}, r"`rollout.vllm_args.dtype` is 'int8'"),
    ({"vllm_args": {"kv_cache_gib": 0}}, r"`rollout.vllm_args.kv_cache_gib` is 0"),
    ({"vllm_args": {"max_lora_rank": 12}}, r"`rollout.vllm_args.max_lora_rank` is 12; vLLM takes one of 1, 8, 16"),
])
def test_what_vllm_cannot_run_is_refused_naming_the_key(rollout, match):
    with pytest.raises(ConfigError, match=match):
        validate(cfg(**rollout))


def test_vllm_args_with_another_backend_and_the_vllm_path_without_vllm_are_refused():
    with pytest.raises(ConfigError, match=r"`rollout.vllm_args.max_num_seqs` is 4 while `rollout.backend` is embedded"):
        validate(load_config({"rollout": {"vllm_args": {"max_num_seqs": 4}}}))
    with pytest.raises(ConfigError, match=r"`rollout.weight_sync` is vllm while `rollout.backend` is embedded"):
        validate(load_config({"rollout": {"weight_sync": "vllm"}}))
    validate(load_config({"rollout": {"backend": "external", "weight_sync": "vllm", "engine_urls": ["http://h:1"]}}))


def test_a_head_size_vllms_cpu_attention_refuses_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"head size is 24; vLLM's CPU attention serves head sizes 32, .* tiny-hd32"):
        prepare_vllm(validate(cfg()), "tiny")
    assert 32 in CPU_HEAD_SIZES and 24 not in CPU_HEAD_SIZES


def test_an_interpreter_without_vllm_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"cannot import vllm; .*`rollout.vllm_args.python`"):
        prepare_vllm(validate(cfg(vllm_args={"python": sys.executable})), "tiny-hd32")
    with pytest.raises(ConfigError, match=r"`rollout.vllm_args.python` is '/nonexistent/python', which cannot be run"):
        prepare_vllm(validate(cfg(vllm_args={"python": "/nonexistent/python"})), "tiny-hd32")


def test_the_server_command_line_and_environment(tmp_path):
    args = VLLMArgs(max_num_seqs=8, kv_cache_gib=2, extra={"max_num_batched_tokens": 512})
    pool = VLLMPool(VLLMPlan("/venv/bin/python", str(tmp_path), None, None), args, cpu_cores=[[1, 2]],
                    context_length=300, log_dir=str(tmp_path))
    cmd = pool.command(8123)
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = {a: cmd[i + 1] if i + 1 < len(cmd) else None for i, a in enumerate(cmd) if a.startswith("--")}
    assert flags["--port"] == "8123" and flags["--max-model-len"] == "300" and flags["--max-num-seqs"] == "8"
    assert flags["--logprobs-mode"] == "processed_logprobs" and "--enable-scale-out" in flags
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "fasync-gloo"}
    assert flags["--max-num-batched-tokens"] == "512" and "--enforce-eager" in flags
    env = pool._env(0)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1,2"


def test_the_adapter_path_starts_the_servers_with_lora_and_every_request_names_the_adapter(tmp_path):
    from lightning_fasync.fleet.vllm import VLLMClient

    validate(cfg(weight_sync="adapter"))  # the adapter path runs on vLLM's LoRA endpoints
    pool = VLLMPool(VLLMPlan("/venv/bin/python", str(tmp_path), None, None), VLLMArgs(max_lora_rank=32),
                    log_dir=str(tmp_path), lora=True)
    cmd = pool.command(8123)
    flags = {a: cmd[i + 1] if i + 1 < len(cmd) else None for i, a in enumerate(cmd) if a.startswith("--")}
    assert "--enable-lora" in flags and flags["--max-loras"] == "1" and flags["--max-lora-rank"] == "32"
    assert pool._env(0)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = VLLMPool(VLLMPlan("/venv/bin/python", str(tmp_path), None, None), VLLMArgs(), log_dir=str(tmp_path))
    assert "--enable-lora" not in plain.command(8123) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain._env(0)

    sent = []

    class Recording(VLLMClient):
        async def _generate(self, request, body):
            sent.append(body)
            return None

    client = Recording(["http://a:1"], lora_name="policy", max_lora_rank=32)
    asyncio.run(client.generate(GenerateRequest("r", [1, 2], SamplingParams(max_new_tokens=2))))
    assert sent[-1]["model"] == "policy" and client.clone().lora_name == "policy"
    asyncio.run(Recording(["http://a:1"]).generate(GenerateRequest("s", [1, 2], SamplingParams(max_new_tokens=2))))
    assert "model" not in sent[-1]


def test_each_request_goes_to_the_least_busy_serving_server():
    from lightning_fasync.fleet.vllm import VLLMClient
    from lightning_fasync.fleet.workers import WorkerSet

    workers = WorkerSet(["http://a:1", "http://b:1", "http://c:1"])
    client = VLLMClient(workers.urls, workers=workers)
    client._busy = {"http://a:1": 3, "http://b:1": 1, "http://c:1": 2}
    assert client._generate_url() == "http://b:1"
    workers.remove("http://b:1")  # out of service: not sent to
    assert client._generate_url() == "http://c:1"
    assert client.clone()._busy == {}  # a clone counts its own requests


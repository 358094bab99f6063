"""Compatibility with SGLang itself: the embedded server driven by SGLang's own code.

The ``sglang`` package (0.5.23, installed without its GPU runtime from
``tests/requirements-sglang.txt`` by ``scripts/_env.sh``) runs in a child process
(``tests/helpers/sglang_driver.py``): its Python frontend (``sgl.function`` with ``gen``, ``select``,
``run_batch`` and streaming) against a real server process, every field of its ``GenerateReqInput``
(read from its source) and its ``SamplingParams`` as msgspec serialises them, its weight-version
span builder, and its OpenAI protocol models parsing our OpenAI-compatible responses. Nothing here
is a field list typed by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lightning_fasync.fleet.launch import launch_server
from tests.helpers.paths import HELPERS
from tests.helpers.required import SGLANG, require


require(*SGLANG, module_level=True)

pytestmark = pytest.mark.slow


DIRECT_CHECKS = ("fields", "frontend", "weight_versions", "openai_models", "server_info")


def drive(url: str, *checks: str) -> dict:
    """Run the driver's checks against ``url`` in one child process; their results by name."""
    proc = subprocess.run([sys.executable, os.path.join(HELPERS, "sglang_driver.py"), url, *checks],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server():
    """A server process, and what SGLang's code saw of it (one driver run for every check)."""
    handle = launch_server("tiny", max_running_requests=8, timeout=120)
    try:
        yield drive(handle.url, *DIRECT_CHECKS)
    finally:
        handle.stop()


def test_every_sglang_request_field_is_accepted(server):
    out = server["fields"]
    assert len(out["generate_fields"]) >= 60 and "sampling_params" in out["generate_fields"]
    assert out["refused"] == {}  # every GenerateReqInput field, null and at its default
    assert out["sampling_ok"], out["sampling_out"]  # SGLang's SamplingParams with all its fields
    assert out["sampling_out"]["meta_info"]["completion_tokens"] <= 3
    assert all(out["unsupported_named"].values()), out["unsupported_named"]


def test_sglang_frontend_runs_against_the_engine(server):
    out = server["frontend"]
    assert out["answer"] and out["meta"]["completion_tokens"] >= 1
    assert out["meta"]["finish_reason"]["type"] in ("length", "stop")
    assert out["batch"][2] == out["answer"]  # greedy: the same question gives the same answer
    assert out["pick"] in ("red", "green", "blue")  # select scores choices with input log-probs
    assert out["stream"] == out["answer"] and out["stream_chunks"] >= 2


def test_weight_version_spans_match_sglangs_builder(server):
    out = server["weight_versions"]
    assert out["ours"] == out["theirs"]


def test_openai_responses_parse_with_sglangs_models(server):
    out = server["openai_models"]
    assert out == {"chat_status": 200, "completion_status": 200, "sglang_chat_request_status": 200}


@pytest.fixture(scope="module")
def routed():
    from lightning_fasync.fleet.pool import RolloutPool

    with RolloutPool("tiny", num_replicas=2, max_running_requests=8) as pool:
        yield pool


def test_sglang_frontend_and_openai_client_through_the_real_router(routed):
    """The same clients against two replicas behind sglang-router, which re-serialises requests.

    (The router itself refuses two things SGLang's own clients send, whatever the worker: batched
    ``text`` in ``/generate`` -- "invalid type: sequence, expected a string" -- which the frontend's
    ``select`` uses, and ``min_tokens: 0`` in a chat request serialised by SGLang's
    ``ChatCompletionRequest`` -- "min_tokens: Validation error: range". Those two are checked
    against the worker directly above.)
    """
    seen = drive(routed.url, "frontend_no_select", "openai_models")
    out, checked = seen["frontend_no_select"], seen["openai_models"]
    assert out["answer"] and out["stream"] == out["answer"] and len(out["batch"]) == 3
    assert (checked["chat_status"], checked["completion_status"]) == (200, 200)
    import openai

    client = openai.OpenAI(base_url=routed.url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                           temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_server_info_has_sglangs_shape(server):
    """``/get_server_info``: the version the client's protocol detection reads, and SGLang's own
    ``ServerArgs`` field names for the server arguments reported (``engine`` and ``lora_dir`` are ours)."""
    out = server["server_info"]
    assert out["version"] == "0.5.23"
    assert out["not_sglangs"] == ["engine", "lora_dir"], out["not_sglangs"]
    args = out["args"]
    assert args["model_path"] == "tiny" and args["host"] == "127.0.0.1" and isinstance(args["port"], int)
    assert args["max_running_requests"] == 8 and args["context_length"] > 0 and args["weight_version"] == "default"

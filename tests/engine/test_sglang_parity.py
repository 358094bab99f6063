"""The embedded server against SGLang 0.5.23's own code, where the two answered differently (issue 30).

A server process started as SGLang's own HTTP tests start theirs (``--max-total-tokens 1000
--context-length 1000``, and ``--enable-metrics``) is sent the requests whose answers SGLang's
functions give in ``tests/engine/sglang_reference.py`` (run in a child process); the answers must
be SGLang's. SGLang's own API-contract kit (``sglang/test/kits/basic_api_contract_kit.py``) runs
against the same server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request

import pytest

from lightning_fasync.fleet.launch import launch_server
from tests.engine.test_sglang_differences import parse_metrics
from tests.helpers.required import SGLANG, require

require(*SGLANG, module_level=True)

pytestmark = pytest.mark.slow

CONTEXT = 1000
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def sglang():
    """What SGLang's own functions answer (``sglang_reference.py``)."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sglang_reference.py"), str(CONTEXT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server():
    handle = launch_server("tiny", context_length=CONTEXT, max_running_requests=8, timeout=120,
                           extra_args=["--max-total-tokens", str(CONTEXT), "--enable-metrics"])
    try:
        yield handle.url
    finally:
        handle.stop()


def post(url: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read().decode()


def test_the_server_starts_with_a_pool_of_one_context_and_serves_all_of_it(server):
    status, text = get(server + "/server_info")
    info = json.loads(text)
    assert (info["max_total_num_tokens"], info["context_length"], info["page_size"]) == (CONTEXT, CONTEXT, 8)
    status, out = post(server + "/generate", {"input_ids": [5] * 900, "sampling_params": {"max_new_tokens": 99,
                                                                                          "ignore_eos": True}})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 99


def test_duplicate_rids_get_sglangs_answers(server, sglang):
    expected = sglang["requests"]
    status, out = post(server + "/generate", {"input_ids": [[5], [6], [7]], "rid": ["a", "b", "a"]})
    assert (status, out["error"]["message"]) == (400, expected["batch_duplicate"])
    done = {}
    first = threading.Thread(target=lambda: done.update(out=post(server + "/generate", {
        "input_ids": [5], "rid": "dup", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})))
    first.start()
    try:
        deadline = time.monotonic() + 30
        while json.loads(get(server + "/get_load")[1])[0]["num_reqs"] == 0:
            assert time.monotonic() < deadline, "the first request never started"
            time.sleep(0.01)
        status, out = post(server + "/generate", {"input_ids": [6], "rid": "dup"})
        assert (status, out["error"]["message"]) == (400, expected["in_flight_duplicate"])
    finally:
        post(server + "/abort_request", {"rid": "dup"})
        first.join(60)
    assert done["out"][0] == 200


def test_token_ids_logprob_errors_are_sglangs(server, sglang):
    from tests.engine.sglang_reference import TOKEN_IDS_LOGPROB_CASES

    for value, message in zip(TOKEN_IDS_LOGPROB_CASES, sglang["requests"]["token_ids_logprob"]):
        for logprob in (False, True):  # SGLang checks them either way
            status, out = post(server + "/generate", {"input_ids": [5], "token_ids_logprob": value,
                                                      "return_logprob": logprob})
            assert (status, out["error"]["message"]) == (400, message), value


def test_a_failed_disk_update_answers_sglangs_body(server, sglang):
    theirs = sglang["update_weights_from_disk"]
    status, out = post(server + "/update_weights_from_disk", {"model_path": "/nonexistent/checkpoint"})
    assert status == theirs["status"] and set(out) == set(theirs["body"])
    assert (out["success"], out["num_paused_requests"]) == (False, 0)
    assert out["message"].startswith("Failed to get weights iterator: ")


def test_server_info_startup_time_has_sglangs_shape(server, sglang):
    info = json.loads(get(server + "/server_info")[1])
    # Every key is one SGLang's server_info writes (ServerArgs fields, the scheduler's handshake ...)
    # but `engine` and `lora_dir` (where adapters load from, which a trainer on this host writes), ours.
    assert sorted(set(info) - set(sglang["server_info_keys"])) == ["engine", "lora_dir"]
    assert {"enable_deterministic_inference", "enable_lora", "max_loras_per_batch"} <= set(sglang["server_info_keys"])
    assert {"max_total_num_tokens", "max_req_input_len", "startup_time"} <= set(sglang["server_info_keys"])

    def shape(d):
        return {k: shape(v) if isinstance(v, dict) else type(v).__name__ for k, v in d.items()}

    assert shape(info["startup_time"]) == shape(sglang["startup_time"])
    assert info["startup_time"]["load_weight"] > 0 and info["startup_time"]["tokenizer_e2e"] >= \
        info["startup_time"]["scheduler_e2e"] >= info["startup_time"]["load_weight"]
    assert info["max_req_input_len"] == CONTEXT - 6


def test_tokenize_and_detokenize_answer_as_sglangs_handlers(server, sglang):
    from tests.engine.sglang_reference import DETOKENIZE_CASES, TOKENIZE_CASES

    for case, theirs in zip(TOKENIZE_CASES, sglang["tokenize"]["tokenize"]):
        for path in ("/tokenize", "/v1/tokenize"):
            assert post(server + path, case) == (theirs["status"], theirs["body"]), case
    for case, theirs in zip(DETOKENIZE_CASES, sglang["tokenize"]["detokenize"]):
        status, out = post(server + "/detokenize", case)
        assert status == theirs["status"], case
        if status == 200:
            assert out == theirs["body"]
        else:  # the message and type of SGLang's error; here in the OpenAI routes' {"error": {...}}
            assert (out["error"]["message"], out["error"]["type"]) == (theirs["body"]["message"], theirs["body"]["type"])


def test_every_metric_is_one_sglang_defines_with_its_type(server, sglang):
    post(server + "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    types, samples = parse_metrics(get(server + "/metrics")[1])
    theirs = sglang["metric_types"]
    assert len(types) >= 20
    for name, kind in types.items():
        assert theirs.get(name + "_total" if kind == "counter" else name) == kind, name
    assert {n for n in samples} >= {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                                    "sglang:gen_throughput", "sglang:prompt_tokens_total",
                                    "sglang:generation_tokens_total", "sglang:num_requests_total"}
    assert all(labels["model_name"] == "tiny" for rows in samples.values() for labels, _ in rows)


def test_sglangs_api_contract_kit_passes(server):
    """SGLang's ``BasicAPIContractMixin``, every probe (its OpenAI probes want non-empty text at
    temperature 0, which the seeded ``tiny`` gives)."""
    spec = importlib.util.find_spec("sglang")
    path = os.path.join(os.path.dirname(spec.origin), "test", "kits", "basic_api_contract_kit.py")
    kit_spec = importlib.util.spec_from_file_location("sglang_basic_api_contract_kit", path)
    kit = importlib.util.module_from_spec(kit_spec)
    kit_spec.loader.exec_module(kit)  # it imports only requests

    class Contract(kit.BasicAPIContractMixin, unittest.TestCase):
        base_url = server

    suite = unittest.defaultTestLoader.loadTestsFromTestCase(Contract)
    assert suite.countTestCases() == 6
    with open(os.devnull, "w") as sink:
        result = unittest.TextTestRunner(stream=sink).run(suite)
    assert result.wasSuccessful(), result.failures + result.errors

"""Drive a server with SGLang's own code: ``python tests/helpers/sglang_driver.py URL CHECK [CHECK ...]``.

Run as a separate process by ``tests/integration/test_sglang_compat.py`` (it installs stand-ins for Triton,
which must not leak into the test process). Prints one JSON object with what each check saw.

SGLang's package imports ``triton`` unconditionally; without a GPU runtime the stand-ins SGLang
itself ships for Apple machines (``sglang/_platform_stubs.py``) are installed first, loaded from
the installed package's file.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import urllib.request
from typing import Any
from unittest import mock


def install_sglang_triton_stubs() -> None:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin, "sglang is not installed"
    path = os.path.join(os.path.dirname(spec.origin), "_platform_stubs.py")
    stub_spec = importlib.util.spec_from_file_location("_sglang_platform_stubs", path)
    stubs = importlib.util.module_from_spec(stub_spec)
    sys.modules[stub_spec.name] = stubs  # its dataclasses look their module up there
    stub_spec.loader.exec_module(stubs)
    import torch

    # install_platform_stubs() only acts on Apple silicon with MPS; it is what is needed here too.
    with mock.patch.object(stubs.sys, "platform", "darwin"), \
            mock.patch.object(stubs.platform, "machine", lambda: "arm64"), \
            mock.patch.object(torch.backends.mps, "is_available", lambda: True):
        stubs.install_platform_stubs()


def post(url: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def dataclass_fields(path: str, cls: str) -> dict[str, Any]:
    """Field names and literal defaults of a dataclass, read from SGLang's source (no import)."""
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            out = {}
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    try:
                        out[item.target.id] = ast.literal_eval(item.value) if item.value is not None else None
                    except ValueError:  # field(default=None, kw_only=True) and the like
                        out[item.target.id] = None
            return out
    raise LookupError(cls)


def check_fields(url: str) -> dict[str, Any]:
    """Every GenerateReqInput field null and at its default; SamplingParams as SGLang serialises it."""
    import msgspec

    spec = importlib.util.find_spec("sglang")
    io_struct = os.path.join(os.path.dirname(spec.origin), "srt", "managers", "io_struct.py")
    fields = dataclass_fields(io_struct, "GenerateReqInput")
    from sglang.srt.sampling.sampling_params import SamplingParams

    refused = {}
    base = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    for name, default in fields.items():
        if name in ("text", "input_ids", "sampling_params"):
            continue
        for value in (None, default):
            status, body = post(url + "/generate", {**base, name: value})
            if status != 200:
                refused[f"{name}={value!r}"] = body
    # SGLang's SamplingParams with every field (internal ones included), as msgspec writes it.
    sp = msgspec.to_builtins(SamplingParams(max_new_tokens=3, temperature=0.0, stop=["\n"]), builtin_types=None)
    if isinstance(sp, list):  # array_like struct: pair the values with the field names
        sp = dict(zip(SamplingParams.__struct_fields__, sp))
    status, out = post(url + "/generate", {"text": "Hello", "sampling_params": sp})
    sampling_ok = status == 200
    # Non-default values of fields the engine cannot honour are refused, naming the field.
    named = {}
    for name, value in (("regex", "a+"), ("json_schema", "{}"), ("beam_width", 4)):
        status, body = post(url + "/generate", {**base, "sampling_params": {**base["sampling_params"], name: value}})
        named[name] = status == 400 and name in str(body)
    return {"generate_fields": sorted(fields), "refused": refused, "sampling_fields": list(SamplingParams.__struct_fields__),
            "sampling_ok": sampling_ok, "sampling_out": out, "unsupported_named": named}


def check_frontend(url: str, with_select: bool = True) -> dict[str, Any]:
    """SGLang's Python frontend: gen, select, run_batch and streaming."""
    import sglang as sgl

    backend = sgl.RuntimeEndpoint(url)
    sgl.set_default_backend(backend)

    # 32 tokens: a stream whose reader falls behind gets the latest cumulative state (as from SGLang's
    # own server), so on a loaded machine a few tokens can arrive as one chunk.
    @sgl.function
    def answer(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=32, temperature=0)

    @sgl.function
    def choose(s):
        s += "Pick one:" + sgl.select("pick", choices=["red", "green", "blue"])

    state = answer.run(question="What is 2 + 2?")
    batch = answer.run_batch([{"question": "a"}, {"question": "b"}, {"question": "What is 2 + 2?"}])
    picked = choose.run() if with_select else {"pick": None}
    streamed = answer.run(question="What is 2 + 2?", stream=True)
    chunks = list(streamed.text_iter("answer"))
    return {
        "answer": state["answer"],
        "meta": state.get_meta_info("answer"),
        "batch": [s["answer"] for s in batch],
        "pick": picked["pick"],
        "stream": "".join(chunks),
        "stream_chunks": len(chunks),
    }


def check_weight_versions(url: str) -> dict[str, Any]:
    """Our spans against SGLang's own span type and meta_info builder."""
    from sglang.srt.utils.weight_versions import WeightVersionSpan, add_weight_versions_to_meta_info

    status, out = post(url + "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}})
    ours = out["meta_info"]
    spans = [WeightVersionSpan(version=s["version"], start=s["start"], end=s["end"]) for s in ours["weight_versions"]]
    theirs: dict[str, Any] = {}
    add_weight_versions_to_meta_info(theirs, spans, num_output_tokens=len(out["output_ids"]))
    return {"ours": {k: ours[k] for k in ("weight_versions", "weight_version")}, "theirs": theirs}


def check_openai_models(url: str) -> dict[str, Any]:
    """Our OpenAI-compatible responses parsed by SGLang's own pydantic response models."""
    from sglang.srt.entrypoints.openai import protocol

    results = {}
    status, chat = post(url + "/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    results["chat_status"] = status
    protocol.ChatCompletionResponse.model_validate(chat)
    status, comp = post(url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4, "logprobs": 2})
    results["completion_status"] = status
    protocol.CompletionResponse.model_validate(comp)
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        protocol.ModelList.model_validate(json.loads(r.read()))
    # SGLang's own request models serialised as SGLang's OpenAI clients would send them.
    request = protocol.ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    status, _ = post(url + "/v1/chat/completions", request.model_dump(exclude_none=True))
    results["sglang_chat_request_status"] = status
    return results


def check_server_info(url: str) -> dict[str, Any]:
    """``/get_server_info``'s keys against SGLang's own: its ``ServerArgs`` fields plus what its
    ``server_info`` endpoint adds (``sglang/srt/entrypoints/http_server.py``), its scheduler's
    handshake among them (``Scheduler.get_init_info``)."""
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as r:
        info = json.loads(r.read())
    fields = {f.name for f in record_fields(ServerArgs)}
    endpoint = {"launch_command", "startup_time", "internal_states", "version", "frontend", "kv_events",
                "status", "max_total_num_tokens", "max_req_input_len", "hicache_object_layout"}
    return {"keys": sorted(info), "not_sglangs": sorted(set(info) - fields - endpoint), "version": info.get("version"),
            "args": {k: info.get(k) for k in ("model_path", "host", "port", "context_length", "max_running_requests",
                                               "weight_version")}}


CHECKS = {"fields": check_fields, "server_info": check_server_info, "frontend": check_frontend,
          # sglang-router 0.3 refuses batched `text`, which select sends: everything else through it.
          "frontend_no_select": lambda url: check_frontend(url, with_select=False), "weight_versions": check_weight_versions,
          "openai_models": check_openai_models}


if __name__ == "__main__":
    # python tests/helpers/sglang_driver.py URL CHECK [CHECK ...]: one process (one sglang import) for all.
    url, checks = sys.argv[1].rstrip("/"), sys.argv[2:]
    install_sglang_triton_stubs()
    print(json.dumps({check: CHECKS[check](url) for check in checks}, default=str))

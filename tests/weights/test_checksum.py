"""``/weights_checker`` (action ``checksum``) and the trainer-side checksums, against SGLang 0.5.23.

SGLang's own functions (``tensor_hash``, ``_hash_tensor``, ``overall_checksum``, the skip rule) are
compiled from the installed package's source files and run here: importing their modules pulls in
SGLang's whole runtime (Triton, torchvision), which the test environment lacks. Field names come
from SGLang's source too (``io_struct.py``, ``http_server.py``). Those checks skip when SGLang is
not installed, unless ``LFA_REQUIRE_SGLANG=1``.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import os
import typing
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch

from lightning_fasync.pipeline.engine_client import EngineError
from lightning_fasync.policy import build_policy
from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.fleet.launch import launch_server
from lightning_fasync.weights.checksum import (
    NON_PERSISTENT_BUFFER_PATTERNS,
    checksums,
    compare,
    engine_checksum_body,
    is_skipped,
    model_state,
    overall_checksum,
    tensor_checksum,
)
from tests.helpers.required import SGLANG, located
from tests.helpers.sglang_driver import dataclass_fields


SGLANG_DIR = located(*SGLANG)  # found without importing it
needs_sglang = pytest.mark.skipif(SGLANG_DIR is None, reason="sglang is not installed (tests/requirements-sglang.txt)")


def _source(relpath: str) -> ast.Module:
    with open(os.path.join(SGLANG_DIR, *relpath.split("/"))) as f:
        return ast.parse(f.read())


def _top_level(tree: ast.Module, names: set[str]) -> list[ast.stmt]:
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            out.append(node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in node.targets):
            out.append(node)
    found = {getattr(n, "name", None) or n.targets[0].id for n in out}
    assert found == names, f"not in SGLang's source: {names - found}"
    return out


def _gpu_hash(*_: Any, **__: Any) -> int:
    raise AssertionError("SGLang's CUDA hash is not used on CPU tensors")


@pytest.fixture(scope="module")
def sglang() -> dict[str, Any]:
    """SGLang 0.5.23's checksum functions, compiled from its source files."""
    if SGLANG_DIR is None:
        pytest.skip("sglang is not installed")
    ns: dict[str, Any] = {"hashlib": hashlib, "torch": torch, "gpu_tensor_hash": _gpu_hash,
                          **{k: getattr(typing, k) for k in ("Any", "Dict", "List", "Optional", "Set")}}
    for relpath, names in (
        ("srt/managers/mm_utils.py", {"tensor_hash", "data_hash"}),
        ("srt/utils/weight_checker.py", {"_NON_PERSISTENT_BUFFER_PATTERNS", "_is_non_persistent_buffer_name",
                                          "_is_skip_weight_check", "overall_checksum", "_hash_tensor"}),
    ):
        module = ast.Module(body=_top_level(_source(relpath), names), type_ignores=[])
        exec(compile(module, f"sglang/{relpath}", "exec"), ns)
    return ns


def _class_fields(relpath: str, cls: str) -> dict[str, Any]:
    """Annotated fields of a class in SGLang's source, with their literal defaults (None otherwise)."""
    return dataclass_fields(os.path.join(SGLANG_DIR, *relpath.split("/")), cls)


def _response_keys() -> set[str]:
    """The keys SGLang's ``/weights_checker`` handler (``check_weights`` in http_server.py) puts in its body."""
    for node in ast.walk(_source("srt/entrypoints/http_server.py")):
        if isinstance(node, ast.AsyncFunctionDef) and node.name == "check_weights":
            keys = set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Dict):
                    keys |= {k.value for k in sub.keys if isinstance(k, ast.Constant)}
                elif isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store):
                    if isinstance(sub.slice, ast.Constant):
                        keys.add(sub.slice.value)
            return keys
    raise LookupError("check_weights")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    return {
        "float32": base,
        "bfloat16": base.to(torch.bfloat16),
        "float16": base.to(torch.float16),
        "int64": torch.randint(-(2**40), 2**40, (17,), generator=g),
        "bool": base > 0,
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "parameter": torch.nn.Parameter(base.clone()),
    }


# ---------------------------------------------------------------------------- SGLang's own rules


@needs_sglang
def test_tensor_checksum_is_sglangs_hash(sglang):
    for name, t in _tensors().items():
        assert tensor_checksum(t) == sglang["_hash_tensor"](t), name
        assert len(tensor_checksum(t)) == 16
    base = _tensors()["float32"]
    assert tensor_checksum(base.t()) != tensor_checksum(base)  # layout counts: C-order bytes
    assert tensor_checksum(base.t()) == tensor_checksum(base.t().contiguous())


@needs_sglang
def test_overall_checksum_and_skip_rule_are_sglangs(sglang):
    assert tuple(sglang["_NON_PERSISTENT_BUFFER_PATTERNS"]) == NON_PERSISTENT_BUFFER_PATTERNS
    sums = checksums(_tensors())
    assert overall_checksum(sums) == sglang["overall_checksum"](sums)
    assert overall_checksum({}) == sglang["overall_checksum"]({})
    marked = torch.zeros(2)
    marked._skip_weight_check = True
    names = ["model.rotary_emb.inv_freq", "layers.0.attn.rotary.cos_sin_cache", "mlp.experts.expert_mask_gpu",
             "model.layers.0.mlp.up_proj.weight", "lm_head.weight", "freqs_cis"]
    for skip in ((), ("up_proj",), ("lm_head", "layers.0")):
        for name in names:
            for t in (torch.zeros(2), marked):
                assert is_skipped(name, t, skip) == sglang["_is_skip_weight_check"](name, t, list(skip)), (name, skip)


@needs_sglang
def test_engine_body_has_sglangs_fields():
    model = torch.nn.Linear(3, 2)
    body = engine_checksum_body(model)
    assert set(body) == _response_keys()
    (rank,) = body["ranks"]
    assert set(rank) == set(_class_fields("srt/managers/io_struct.py", "ChecksumInfo"))
    (info,) = rank["parallelism_info"]
    assert set(info) == set(_class_fields("srt/managers/io_struct.py", "ParallelismInfo"))


# ---------------------------------------------------------------------------- trainer side


def test_checksums_compare_and_body():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    model.register_buffer("inv_freq", torch.ones(4), persistent=False)
    model.register_buffer("step", torch.tensor(7))
    state = model_state(model)
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias", "inv_freq", "step"]  # parameters, then buffers
    sums = checksums(state)
    assert list(sums) == ["0.weight", "0.bias", "1.weight", "1.bias", "step"]
    assert list(checksums(state, skip=["bias", "step"])) == ["0.weight", "1.weight"]

    body = engine_checksum_body(model, ["1."])
    (rank,) = body["ranks"]
    assert body["success"] is True and rank["checksums"] == checksums(state, skip=["1."])
    assert rank["per_gpu_checksum"] == overall_checksum(rank["checksums"])
    assert body["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    assert rank["parallelism_info"] == [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                         "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]
    json.dumps(body)  # plain JSON

    assert compare(sums, dict(sums)) == []
    assert compare({**sums, "extra.weight": "0" * 16}, sums) == []  # names only expected are no difference
    changed = {**sums, "0.bias": "f" * 16, "new.weight": "1" * 16}
    diffs = compare(sums, changed)
    assert len(diffs) == 2
    assert "0.bias" in diffs[0] and "f" * 16 in diffs[0] and sums["0.bias"] in diffs[0]
    assert "new.weight" in diffs[1] and "not expected" in diffs[1]


# ---------------------------------------------------------------------------- the endpoint


def _call(url: str, method: str = "POST", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + "/weights_checker", data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server():
    handle = launch_server("tiny", max_running_requests=4, timeout=120)
    try:
        yield handle.url
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def tiny_sums() -> dict[str, str]:
    """The checksums of the tiny preset as the server builds it (a seeded model)."""
    model, _ = build_policy("tiny")
    return checksums(model_state(model))


@pytest.mark.slow
def test_endpoint_answers_sglangs_body(server, tiny_sums):
    for method, body in (("GET", None), ("POST", None), ("POST", {}), ("POST", {"action": "checksum"})):
        status, out = _call(server, method, body)
        assert status == 200, (method, body, out)
        assert set(out) == {"success", "message", "ranks", "per_engine_checksum"}
        assert out["success"] is True
        (rank,) = out["ranks"]
        assert set(rank) == {"checksums", "per_gpu_checksum", "parallelism_info"}
        assert rank["checksums"] == tiny_sums
        assert list(rank["checksums"]) == list(tiny_sums)  # parameters, then buffers, as SGLang
        assert "model.rotary_emb.inv_freq" not in rank["checksums"]
        assert rank["per_gpu_checksum"] == overall_checksum(tiny_sums)
        assert out["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
        assert rank["parallelism_info"][0]["role"] == "target"


@pytest.mark.slow
@needs_sglang
def test_endpoint_accepts_every_sglang_field(server):
    fields = _class_fields("srt/managers/io_struct.py", "CheckWeightsReqInput")
    assert {"action", "allow_quant_error", "skip_tensor_list", "selector"} <= set(fields)
    fields.update(rid=None, http_worker_ipc=None)  # BaseReq's
    for name, default in fields.items():
        for value in (None, default):
            status, out = _call(server, "POST", {name: value})
            assert status == 200 and out["success"] is True, (name, value, out)


@pytest.mark.slow
def test_endpoint_options_and_refusals(server, tiny_sums):
    status, out = _call(server, "POST", {"skip_tensor_list": ["mlp", "lm_head"], "selector": "target"})
    assert status == 200
    assert out["ranks"][0]["checksums"] == {k: v for k, v in tiny_sums.items() if "mlp" not in k and "lm_head" not in k}

    # No draft model: SGLang answers success without ranks when no runner matches the selector.
    assert _call(server, "POST", {"selector": "draft"}) == (200, {"success": True, "message": "Success."})

    for action in ("snapshot", "reset_tensors", "compare", "reset"):
        status, out = _call(server, "POST", {"action": action})
        assert status == 400 and out["success"] is False, out
        assert repr(action) in out["message"] and "'checksum'" in out["message"]

    for body, needle in (
        ({"frobnicate": 1}, "Unknown field(s) for weights_checker: frobnicate"),
        ({"selector": "both"}, "`selector` must be"),
        ({"skip_tensor_list": "mlp"}, "`skip_tensor_list` must be a list"),
        ({"skip_tensor_list": [1]}, "`skip_tensor_list` must be a list of strings"),
        ({"action": 3}, "`action` must be a string"),
    ):
        status, out = _call(server, "POST", body)
        assert status == 400 and needle in out["error"]["message"], (body, out)


@pytest.mark.slow
def test_checksums_follow_a_weight_update(server, tiny_sums):
    g = torch.Generator().manual_seed(1)
    pushed = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 96, generator=g),
        "model.norm.weight": torch.rand(96, generator=g) + 0.5,
        "lm_head.weight": torch.randn(99, 96, generator=g),
    }

    async def main() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        client = SGLangClient([server])
        try:
            before = await client.weight_checksums()
            # A checksum while a request generates: both answer.
            request = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}
            gen = client._request("POST", server + "/generate", request)
            sums, out = await asyncio.gather(client.weight_checksums(), gen)
            assert sums == before and out["meta_info"]["completion_tokens"] >= 1
            await client.update_weights_from_tensor(pushed, weight_version=5)
            return before, await client.weight_checksums()
        finally:
            await client.close()

    (before,), (after,) = asyncio.run(asyncio.wait_for(main(), 60))
    assert before == tiny_sums
    expected = {**tiny_sums, **checksums(pushed)}
    assert compare(expected, after) == []
    assert after == expected
    diffs = compare(tiny_sums, after)
    assert sorted(d.split(":")[0] for d in diffs) == sorted(pushed)


def test_client_refuses_a_body_without_checksums():
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def main() -> None:
        answers = iter([{"success": True, "message": "Success."}, {"success": False, "message": "boom"}])

        async def handler(request: web.Request) -> web.Response:
            return web.json_response(next(answers))

        app = web.Application()
        app.router.add_post("/weights_checker", handler)
        srv = TestServer(app, host="127.0.0.1")
        await srv.start_server()
        url = str(srv.make_url("")).rstrip("/")
        client = SGLangClient([url], retries=0)
        try:
            with pytest.raises(EngineError, match=f"{url} gave no checksums: Success"):
                await client.weight_checksums()
            with pytest.raises(EngineError, match=f"{url} gave no checksums: boom"):
                await client.weight_checksums()
        finally:
            await client.close()
            await srv.close()

    asyncio.run(asyncio.wait_for(main(), 30))

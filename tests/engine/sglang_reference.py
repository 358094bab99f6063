"""SGLang 0.5.23's own answers, computed by its own code: ``python tests/engine/sglang_reference.py CONTEXT_LEN``.

Run as a child process by ``tests/engine/test_sglang_parity.py`` (``CONTEXT_LEN``: the served
context length, which SGLang's ``/tokenize`` reports for a tokenizer without a length limit).
SGLang's import needs stand-ins for Triton (``tests/helpers/sglang_driver.py`` installs them),
which must not leak into the test process. The modules holding request validation
(``io_struct``, ``tokenizer_manager``, ``http_server``, ``serving_tokenize``) import SGLang's
multimodal stack, which needs torchvision (absent beside the CPU torch): their functions are taken
from the installed source as written (:func:`sglang_function`) and run with the names they use.
Prints one JSON object: for each behaviour the embedded engine copies, what SGLang's functions
answer for the inputs the test sends to the embedded server:

- ``GenerateReqInput._validate_rid_uniqueness`` on a batch that repeats a rid;
- ``TokenizerManager._init_req_state`` for a rid already in flight, and
  ``_validate_token_ids_logprob`` on bad ``token_ids_logprob`` values (each on a stand-in holding
  just the state it reads);
- the ``/update_weights_from_disk`` route's answer to a failed load;
- ``OpenAIServingTokenize`` / ``OpenAIServingDetokenize``'s handlers over the ``tiny`` preset's tokenizer;
- the ``startup_time`` shape of ``build_engine_startup_time``;
- the type of every ``sglang:*`` metric its collectors define;
- every key its ``/server_info`` can hold.
"""

from __future__ import annotations

import __future__
import ast
import asyncio
import copy
import importlib.util
import json
import logging
import os
import sys
from collections import Counter
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.sglang_driver import install_sglang_triton_stubs  # noqa: E402

VOCAB = 99  # the tiny preset's
TOKEN_IDS_LOGPROB_CASES = ([[1, 2]], ["a"], [VOCAB], [1_000_000])
TOKENIZE_CASES = ({"prompt": "Hello"}, {"prompt": ["Hello", "ab"]}, {"prompt": "Hi", "add_special_tokens": False})
DETOKENIZE_CASES = ({"tokens": [40, 41, 42]}, {"tokens": [[40], [41, 42]]}, {"tokens": []},
                    {"tokens": [40, "x"]}, {"tokens": [[40], [41, "x"]]})


def source_path(relpath: str) -> str:
    spec = importlib.util.find_spec("sglang")
    return os.path.join(os.path.dirname(spec.origin), *relpath.split("/"))


def sglang_function(relpath: str, qualname: str, names: dict[str, Any]) -> Callable:
    """The function (or ``Class.method``) ``qualname`` of SGLang's ``relpath``, compiled from the
    installed source without its decorators, its global names taken from ``names``."""
    tree = ast.parse(open(source_path(relpath)).read())
    scope: list[ast.stmt] = tree.body
    *owners, name = qualname.split(".")
    for owner in owners:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner).body
    node = copy.deepcopy(next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                              and n.name == name))
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    namespace = dict(names)
    exec(compile(module, relpath, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    return namespace[name]


def _message(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return ""


def requests_and_rids() -> dict:
    unique = sglang_function("srt/managers/io_struct.py", "GenerateReqInput._validate_rid_uniqueness",
                             {"Counter": Counter})
    init_state = sglang_function("srt/managers/tokenizer_manager.py", "TokenizerManager._init_req_state", {})
    check_ids = sglang_function("srt/managers/tokenizer_manager.py", "TokenizerManager._validate_token_ids_logprob", {})
    # A normalised single request (is_single, rid) whose rid a running request holds.
    single = SimpleNamespace(rid="dup", is_single=True, received_time=None, bootstrap_room=None)
    manager = SimpleNamespace(rid_to_state={"dup": object()}, enable_trace=False)
    validator = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))
    return {
        "batch_duplicate": _message(lambda: unique(SimpleNamespace(rid=["a", "b", "a"]))),
        "in_flight_duplicate": _message(lambda: init_state(manager, single)),
        "token_ids_logprob": [_message(lambda: check_ids(validator, SimpleNamespace(token_ids_logprob=value)))
                              for value in TOKEN_IDS_LOGPROB_CASES],
    }


def update_weights_from_disk_failure() -> dict:
    from fastapi.responses import ORJSONResponse

    async def failed_update(obj, request):
        return False, "Failed to get weights iterator: no such model.", 0

    state = SimpleNamespace(tokenizer_manager=SimpleNamespace(update_weights_from_disk=failed_update))
    route = sglang_function("srt/entrypoints/http_server.py", "update_weights_from_disk",
                            {"_global_state": state, "ORJSONResponse": ORJSONResponse, "HTTPStatus": HTTPStatus})
    response = asyncio.run(route(SimpleNamespace(model_path="/nonexistent"), None))
    return {"status": response.status_code, "body": json.loads(response.body)}


def tokenize_and_detokenize(context_len: int) -> dict:
    from fastapi.responses import ORJSONResponse
    from sglang.srt.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                                         TokenizeRequest, TokenizeResponse)

    from lightning_fasync.policy import build_policy

    _, tokenizer = build_policy("tiny")
    names = {"TokenizeResponse": TokenizeResponse, "DetokenizeResponse": DetokenizeResponse, "HTTPStatus": HTTPStatus,
             "logger": logging.getLogger("sglang_reference"), "List": list, "Union": Any}
    error = sglang_function("srt/entrypoints/openai/serving_base.py", "OpenAIServingBase.create_error_response",
                            {"ErrorResponse": ErrorResponse, "ORJSONResponse": ORJSONResponse})
    serving = SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=tokenizer,
                                                               model_config=SimpleNamespace(context_len=context_len)))
    serving.create_error_response = lambda *a, **k: error(serving, *a, **k)

    def answer(handler: Callable, request: Any) -> dict:
        out = asyncio.run(handler(serving, request, request, None))
        if hasattr(out, "model_dump"):
            return {"status": 200, "body": out.model_dump()}
        return {"status": out.status_code, "body": json.loads(out.body)}

    tokenize = sglang_function("srt/entrypoints/openai/serving_tokenize.py",
                               "OpenAIServingTokenize._handle_non_streaming_request", names)
    detokenize = sglang_function("srt/entrypoints/openai/serving_tokenize.py",
                                 "OpenAIServingDetokenize._handle_non_streaming_request", names)
    return {
        "tokenize": [answer(tokenize, TokenizeRequest(**case)) for case in TOKENIZE_CASES],
        # model_construct: the invalid cases past pydantic, to the handler's own checks.
        "detokenize": [answer(detokenize, DetokenizeRequest.model_construct(skip_special_tokens=True, **case))
                       for case in DETOKENIZE_CASES],
    }


def startup_time() -> dict:
    from sglang.srt.observability.startup_time import build_engine_startup_time

    return build_engine_startup_time([None], tokenizer_e2e=0.0)


def server_info_keys() -> list[str]:
    """Every top-level key SGLang's ``/server_info`` can hold: its ``ServerArgs`` fields, and the keys
    that ``server_info``, ``build_server_info`` and the scheduler's handshake (``get_init_info``,
    merged in as ``scheduler_info``) write, read from their source."""
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.server_args import ServerArgs

    keys = {f.name for f in record_fields(ServerArgs)}
    for relpath, qualname in (("srt/entrypoints/http_server.py", "server_info"),
                              ("srt/utils/common.py", "build_server_info"),
                              ("srt/managers/scheduler.py", "Scheduler.get_init_info")):
        tree = ast.parse(open(source_path(relpath)).read())
        scope: list[ast.stmt] = tree.body
        *owners, name = qualname.split(".")
        for owner in owners:
            scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner).body
        function = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
        for node in ast.walk(function):
            if isinstance(node, ast.Dict):
                keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
    return sorted(keys)


def metric_types() -> dict:
    """``{"sglang:...": "gauge" | "counter" | "histogram"}`` from the collectors' source."""
    types = {}
    for node in ast.walk(ast.parse(open(source_path("srt/observability/metrics_collector.py")).read())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Gauge", "Counter",
                                                                                             "Histogram"):
            for kw in node.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant) and str(kw.value.value).startswith("sglang:"):
                    types[kw.value.value] = node.func.id.lower()
    return types


if __name__ == "__main__":
    install_sglang_triton_stubs()
    print(json.dumps({"requests": requests_and_rids(), "update_weights_from_disk": update_weights_from_disk_failure(),
                      "tokenize": tokenize_and_detokenize(int(sys.argv[1])), "startup_time": startup_time(),
                      "metric_types": metric_types(), "server_info_keys": server_info_keys()}, default=str))

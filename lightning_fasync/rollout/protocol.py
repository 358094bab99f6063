"""SGLang native-API request parsing and response building for the embedded engine.

Every rejection raises ``BadRequest`` with a message naming the field and what is wrong; the server
turns it into a 400 and keeps serving. Fields SGLang defines but this engine does not implement are
refused when set to a non-default value rather than silently ignored.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from lightning_fasync.rollout.engine import EngineRequest


class BadRequest(ValueError):
    """A request the server answers with 400."""


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "a list", dict: "an object"}

# Top-level /generate fields. Values of None mean "not given" (routers re-serialise with nulls).
GENERATE_FIELDS = {
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_text_in_logprobs", "stream", "lora_path", "custom_logit_processor",
    "return_hidden_states", "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank",
    "image_data", "video_data", "audio_data", "input_embeds", "log_metrics", "modalities", "session_params",
    "priority", "extra_key", "routing_key", "routed_dp_rank",
    # Added by sglang-router when it re-serialises a request:
    "background", "model", "no_logs", "return_bytes", "return_entropy",
}
_MUST_BE_UNSET = {"lora_path", "custom_logit_processor", "input_embeds", "image_data", "video_data", "audio_data",
                  "session_params", "token_ids_logprob"}
SAMPLING_FIELDS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed",
    "min_p", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "stop",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
}


def _check_type(name: str, value: Any, typ: type) -> Any:
    ok = isinstance(value, typ) and not (isinstance(value, bool) and typ is not bool)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise BadRequest(f"`{name}` must be {_TYPE_NAMES.get(typ, typ.__name__)}, got {type(value).__name__} {value!r:.60}.")
    return value


def check_fields(body: dict[str, Any], allowed: set[str], where: str) -> None:
    """Refuse unknown fields, naming them."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"Unknown field(s) for {where}: {', '.join(unknown)}.")


def opt(body: dict[str, Any], name: str, typ: type, default: Any) -> Any:
    """An optional field of type ``typ`` (None counts as absent)."""
    value = body.get(name)
    return default if value is None else _check_type(name, value, typ)


def req(body: dict[str, Any], name: str, typ: type) -> Any:
    """A required field of type ``typ``."""
    if body.get(name) is None:
        raise BadRequest(f"Missing required field `{name}`.")
    return _check_type(name, body[name], typ)


@dataclass
class ParsedGenerate:
    """A validated ``/generate`` request."""

    rid: str
    input_ids: list[int]
    sampling: dict[str, Any]
    return_logprob: bool
    return_text_in_logprobs: bool

    def to_engine_request(self, on_finish: Callable[[EngineRequest], None]) -> EngineRequest:
        return EngineRequest(rid=self.rid, input_ids=self.input_ids, on_finish=on_finish, **self.sampling)


def _token_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise BadRequest(f"`{name}` must be a list of token ids, got {type(value).__name__}.")
    if value and isinstance(value[0], list):
        raise BadRequest(f"Batched `{name}` (a list of lists) is not supported; send one request per prompt.")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool):
            raise BadRequest(f"`{name}` must contain integers only, got {type(v).__name__} {v!r:.30}.")
    return list(value)


def parse_sampling(sp: Any) -> dict[str, Any]:
    """Validate ``sampling_params``; returns ``EngineRequest`` keyword arguments."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(f"`sampling_params` must be an object, got {type(sp).__name__}.")
    check_fields(sp, SAMPLING_FIELDS, "sampling_params")
    out = {
        "max_new_tokens": opt(sp, "max_new_tokens", int, 128),
        "temperature": opt(sp, "temperature", float, 1.0),
        "top_p": opt(sp, "top_p", float, 1.0),
        "top_k": opt(sp, "top_k", int, -1),
        "ignore_eos": opt(sp, "ignore_eos", bool, False),
        "sampling_seed": opt(sp, "sampling_seed", int, None),
        "stop_token_ids": tuple(_token_list("sampling_params.stop_token_ids", sp.get("stop_token_ids") or [])),
    }
    if out["max_new_tokens"] <= 0:
        raise BadRequest(f"`sampling_params.max_new_tokens` must be > 0, got {out['max_new_tokens']}.")
    # Accepted only at their neutral values: the engine does not implement them.
    neutral = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
               "min_new_tokens": 0, "n": 1}
    for name, value in neutral.items():
        if sp.get(name) is not None and sp[name] != value:
            raise BadRequest(f"`sampling_params.{name}`={sp[name]!r} is not supported by the embedded engine.")
    if sp.get("stop"):
        raise BadRequest("`sampling_params.stop` (stop strings) is not supported; use stop_token_ids.")
    return out


def parse_generate(body: dict[str, Any], tokenizer: Any) -> ParsedGenerate:
    """Validate a ``/generate`` body (single request, non-streaming)."""
    check_fields(body, GENERATE_FIELDS, "/generate")
    for name in _MUST_BE_UNSET:
        if body.get(name):
            raise BadRequest(f"`{name}` is not supported by the embedded engine.")
    if body.get("stream"):
        raise BadRequest("`stream`=true is not supported by the embedded engine.")
    if opt(body, "top_logprobs_num", int, 0) > 0:
        raise BadRequest("`top_logprobs_num` > 0 is not supported by the embedded engine.")
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise BadRequest("Give either `text` or `input_ids`, not both.")
    if ids is not None:
        input_ids = _token_list("input_ids", ids)
    elif text is not None:
        if not isinstance(text, str):
            raise BadRequest("`text` must be a string (batched text is not supported).")
        input_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        raise BadRequest("Either `text` or `input_ids` must be given.")
    if not input_ids:
        raise BadRequest("The prompt is empty; give at least one input token.")
    rid = opt(body, "rid", str, None) or uuid.uuid4().hex
    return ParsedGenerate(
        rid=rid,
        input_ids=input_ids,
        sampling=parse_sampling(body.get("sampling_params")),
        return_logprob=opt(body, "return_logprob", bool, False),
        return_text_in_logprobs=opt(body, "return_text_in_logprobs", bool, False),
    )


def generate_response(
    req: EngineRequest, gen: ParsedGenerate, tokenizer: Optional[Any], current_version: Optional[str] = None
) -> dict[str, Any]:
    """SGLang's ``/generate`` response for a finished request.

    ``weight_version`` is SGLang's single label (the last generated token's version, or
    ``current_version`` when no token was generated); ``weight_versions`` adds the per-token spans
    ``[[start, end, version], ...]`` (end exclusive) that partial rollouts need.
    """
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "e2e_latency": (req.finished_at or req.created_at) - req.created_at,
        "weight_version": req.output_versions[-1] if req.output_versions else current_version,
        "weight_versions": req.version_spans(),
    }
    if gen.return_logprob:
        texts = [None] * len(req.output_ids)
        if gen.return_text_in_logprobs and tokenizer is not None:
            texts = [tokenizer.decode([t]) for t in req.output_ids]
        meta["output_token_logprobs"] = [[lp, tok, txt] for lp, tok, txt in zip(req.output_logprobs, req.output_ids, texts)]
    text = tokenizer.decode(req.output_ids, skip_special_tokens=True) if tokenizer is not None else ""
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

"""SGLang native-API request parsing and response building for the embedded engine.

The field tables below follow SGLang 0.5.15–0.5.23 (``srt/managers/io_struct.py::GenerateReqInput``
and ``srt/sampling/sampling_params.py::SamplingParams``; ``tests/integration/test_sglang_compat.py`` checks them
against the installed ``sglang`` package). Every field SGLang defines is accepted: null or its
default value means "not used". A field the engine implements is honoured; a field it does not
implement is refused with a 400 naming it only when it asks for something (a non-default value);
metadata that does not change the output (priorities, routing keys, trace headers) is accepted as
is. A field name SGLang does not define is refused. Every rejection raises ``BadRequest`` with a
message naming the field; the server turns it into a 400 and keeps serving.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lightning_fasync.engine.engine import EngineRequest

MAX_N = 4096
"""Most samples one request may ask for (``sampling_params.n``): each is a request of its own, made
before any runs, so a request body of a few bytes must not ask for millions."""


class BadRequest(ValueError):
    """A request the server answers with 400."""


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "a list", dict: "an object"}

# ---------------------------------------------------------------------------- /generate fields

# Implemented: read by parse_generate.
_GENERATE_IMPLEMENTED = {
    "rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_text_in_logprobs", "stream", "return_prompt_token_ids",
}
# Metadata: scheduling hints, tracing and accounting that do not change what is generated.
_GENERATE_METADATA = {
    "log_metrics", "routing_key", "conversation_id", "priority", "extra_key", "cache_salt", "no_logs",
    "custom_labels", "external_trace_header", "received_time", "http_worker_ipc", "background", "kv_hints",
    "need_wait_for_mm_inputs", "num_items_assigned",
    "model",  # added by sglang-router when it re-serialises a request
}
# Data-parallel rank pins: this server is one DP rank (0).
_GENERATE_DP_RANK = {"routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"}
# Not implemented: accepted at their default (None or the value given here), refused otherwise.
_GENERATE_UNSUPPORTED: dict[str, Any] = {
    "session_id": None, "session_params": None, "input_embeds": None, "image_data": None, "video_data": None,
    "audio_data": None, "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False,
    "video_config": None, "watermark": None, "return_sampling_mask": False, "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False, "return_hidden_states": False, "return_routed_experts": False,
    "routed_experts_start_len": 0, "return_indexer_topk": False, "modalities": None, "lora_path": None,
    "lora_id": None, "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "require_reasoning": False, "max_thinking_tokens": None, "return_bytes": False,
    "return_entropy": False, "encoder_urls": None, "max_dynamic_patch": None, "min_dynamic_patch": None,
    "image_max_dynamic_patch": None, "video_max_dynamic_patch": None, "images_config": None,
    "mm_processor_kwargs": None, "multi_item_delimiter_indices": None, "token_indices_to_pool": None,
    "mm_data_mooncake": None,
}
GENERATE_FIELDS = _GENERATE_IMPLEMENTED | _GENERATE_METADATA | _GENERATE_DP_RANK | set(_GENERATE_UNSUPPORTED)

# ---------------------------------------------------------------------------- sampling_params fields

_SAMPLING_IMPLEMENTED = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "min_new_tokens", "n", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "sampling_seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
    "custom_params",  # read only by custom logit processors, which are refused above
    # SGLang's derived fields, present when a client serialises a normalised SamplingParams:
    # stop_strs / stop_regex_strs join the stop lists; the rest is recomputed here.
    "stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized",
}
_SAMPLING_UNSUPPORTED: dict[str, Any] = {
    "beam_width": None, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "watermark": None, "ebnf_full_assistant": False,
}
SAMPLING_FIELDS = _SAMPLING_IMPLEMENTED | set(_SAMPLING_UNSUPPORTED)

# The feature each refused field asks for, named in the refusal (here and in the OpenAI routes).
_MULTIMODAL = (
    "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config",
    "modalities", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
    "video_max_dynamic_patch", "images_config", "mm_processor_kwargs", "mm_data_mooncake",
)
UNSUPPORTED_FEATURES: dict[str, str] = {
    **{name: "constrained decoding" for name in ("json_schema", "regex", "ebnf", "structural_tag",
                                                   "ebnf_full_assistant", "response_format")},
    **{name: "multimodal inputs" for name in _MULTIMODAL},
    "lora_path": "LoRA adapters", "lora_id": "LoRA adapters",
    "session_id": "sessions", "session_params": "sessions",
    "input_embeds": "input embeddings", "positional_embed_overrides": "input embeddings",
    "beam_width": "beam search", "watermark": "watermarking",
    "custom_logit_processor": "custom logit processors",
    "return_hidden_states": "returning hidden states",
    "return_routed_experts": "returning routed experts (MoE)",
    "routed_experts_start_len": "returning routed experts (MoE)",
    "return_indexer_topk": "returning indexer top-k", "return_entropy": "returning entropy",
    "return_bytes": "returning output bytes",
    "return_sampling_mask": "sampling masks", "sampling_logprobs_mode": "sampling masks",
    **{name: "flat raw top log-probs" for name in ("return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
                                                   "return_flat_raw_top_logprobs_b64")},
    **{name: "prefill-decode disaggregation" for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room",
                                                          "bootstrap_pair_key", "decode_tp_size")},
    "require_reasoning": "reasoning control", "max_thinking_tokens": "reasoning control",
    "multi_item_delimiter_indices": "multi-item scoring", "token_indices_to_pool": "multi-item scoring",
    "suffix": "suffixes (fill-in-the-middle)",
    # OpenAI request fields of the chat route.
    "return_input_ids_in_sglext": "returning token ids in sglext",
    "return_output_ids_in_sglext": "returning token ids in sglext",
    "functions": "legacy function calling", "function_call": "legacy function calling", "audio": "audio output",
    "prediction": "predicted outputs", "web_search_options": "web search", "best_of": "best-of sampling",
    "manifest": "partial weight loads (a tensor manifest)",
}
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
MAX_STOP_COUNT = 32
STOP_REGEX_WINDOW_TOKENS = 32  # stop_regex is matched against the decoded last tokens


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


def opt(body: dict[str, Any], name: str, typ: type, default: Any, prefix: str = "") -> Any:
    """An optional field of type ``typ`` (None counts as absent)."""
    value = body.get(name)
    return default if value is None else _check_type(prefix + name, value, typ)


def req(body: dict[str, Any], name: str, typ: type) -> Any:
    """A required field of type ``typ``."""
    if body.get(name) is None:
        raise BadRequest(f"Missing required field `{name}`.")
    return _check_type(name, body[name], typ)


def _is_unset(value: Any, default: Any) -> bool:
    return value is None or value == default or (isinstance(value, (str, list, dict)) and not value and not default)


def unsupported(name: str, value: Any, accepted: str, prefix: str = "") -> BadRequest:
    """The refusal of a field the engine does not implement: it names the field, its value, the
    feature it asks for and what is accepted."""
    feature = UNSUPPORTED_FEATURES.get(name)
    what = f"the embedded engine does not support {feature}" if feature else "the embedded engine does not implement it"
    return BadRequest(f"`{prefix}{name}`={value!r:.80} is not supported: {what} (only {accepted} is accepted).")


def _refuse_unsupported(body: dict[str, Any], table: dict[str, Any], prefix: str) -> None:
    for name, default in table.items():
        if name in body and not _is_unset(body[name], default):
            raise unsupported(name, body[name], "null" if default is None else repr(default), prefix)


# ---------------------------------------------------------------------------- parsed requests


@dataclass
class GenItem:
    """One prompt-and-sample of a ``/generate`` call (a batch and ``n`` expand into several)."""

    index: int
    rid: str  # the engine request's: ``<request_rid>_<k>`` for the k-th of n > 1 samples
    input_ids: list[int]
    sampling: dict[str, Any]  # EngineRequest keyword arguments
    stop_strs: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream_interval: int = 1
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    request_rid: str = ""  # the prompt's rid as the client gave (or SGLang made) it; "" means ``rid``

    @property
    def client_rid(self) -> str:
        return self.request_rid or self.rid


@dataclass
class ParsedGenerate:
    """A validated ``/generate`` request: its items in SGLang's output order."""

    items: list[GenItem]
    is_single: bool
    stream: bool


def _token_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise BadRequest(f"`{name}` must be a list of token ids, got {type(value).__name__}.")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool):
            raise BadRequest(f"`{name}` must contain integers only, got {type(v).__name__} {v!r:.30}.")
    return list(value)


def _str_list(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise BadRequest(f"`{name}` must be a string or a list of strings.")
    values = [v for v in values if v]
    if len(values) > MAX_STOP_COUNT:
        raise BadRequest(f"`{name}`: at most {MAX_STOP_COUNT} are allowed, got {len(values)}.")
    return values


def parse_sampling(sp: Any, where: str = "sampling_params") -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate one ``sampling_params`` object.

    Returns:
        ``(engine_kwargs, text_options)``: ``EngineRequest`` keyword arguments (``max_new_tokens``
        None means "up to the context length") and the text-level options (stop strings and
        regexes, trimming, special tokens, stream interval, ``n``).
    """
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(f"`{where}` must be an object, got {type(sp).__name__}.")
    check_fields(sp, SAMPLING_FIELDS, where)
    _refuse_unsupported(sp, _SAMPLING_UNSUPPORTED, where + ".")
    p = where + "."
    top_k = opt(sp, "top_k", int, -1, p)
    out = {
        "max_new_tokens": opt(sp, "max_new_tokens", int, None, p) if "max_new_tokens" in sp else 128,
        "temperature": opt(sp, "temperature", float, 1.0, p),
        "top_p": opt(sp, "top_p", float, 1.0, p),
        "top_k": -1 if top_k >= TOP_K_ALL else top_k,
        "min_p": opt(sp, "min_p", float, 0.0, p),
        "min_new_tokens": opt(sp, "min_new_tokens", int, 0, p),
        "ignore_eos": opt(sp, "ignore_eos", bool, False, p),
        "sampling_seed": opt(sp, "sampling_seed", int, None, p),
        "stop_token_ids": tuple(_token_list(p + "stop_token_ids", sp.get("stop_token_ids") or [])),
        "frequency_penalty": opt(sp, "frequency_penalty", float, 0.0, p),
        "presence_penalty": opt(sp, "presence_penalty", float, 0.0, p),
        "repetition_penalty": opt(sp, "repetition_penalty", float, 1.0, p),
        "logit_bias": _logit_bias(p + "logit_bias", sp.get("logit_bias")),
    }
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= out[name] <= 2.0:
            raise BadRequest(f"`{p}{name}` must be in [-2, 2], got {out[name]}.")
    if not 0.0 < out["repetition_penalty"] <= 2.0:
        raise BadRequest(f"`{p}repetition_penalty` must be in (0, 2] (1.0 = no penalty), got {out['repetition_penalty']}.")
    if out["max_new_tokens"] is not None and out["max_new_tokens"] < 0:
        raise BadRequest(f"`{p}max_new_tokens` must be at least 0, got {out['max_new_tokens']}.")
    if out["temperature"] < 0 or out["temperature"] != out["temperature"]:
        raise BadRequest(f"`{p}temperature` must be a non-negative finite number, got {out['temperature']}.")
    if not 0 < out["top_p"] <= 1:
        raise BadRequest(f"`{p}top_p` must be in (0, 1], got {out['top_p']}.")
    if out["top_k"] == 0 or out["top_k"] < -1:
        raise BadRequest(f"`{p}top_k` must be -1 (disable) or at least 1, got {top_k}.")
    if not 0 <= out["min_p"] <= 1:
        raise BadRequest(f"`{p}min_p` must be in [0, 1], got {out['min_p']}.")
    if out["min_new_tokens"] < 0 or (out["max_new_tokens"] is not None and out["min_new_tokens"] > out["max_new_tokens"]):
        raise BadRequest(f"`{p}min_new_tokens` must be in [0, max_new_tokens], got {out['min_new_tokens']}.")
    if sp.get("custom_params") is not None and not isinstance(sp["custom_params"], dict):
        raise BadRequest(f"`{p}custom_params` must be an object.")
    n = opt(sp, "n", int, 1, p)
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"`{p}n` must be in [1, {MAX_N}], got {n}.")
    stream_interval = opt(sp, "stream_interval", int, 1, p)
    if stream_interval < 1:
        raise BadRequest(f"`{p}stream_interval` must be at least 1, got {stream_interval}.")
    regexes = _merged(_str_list(p + "stop_regex", sp.get("stop_regex")), _str_list(p + "stop_regex_strs", sp.get("stop_regex_strs")))
    for r in regexes:
        try:
            re.compile(r)
        except re.error as exc:
            raise BadRequest(f"`{p}stop_regex` {r!r} is not a valid regular expression: {exc}.") from None
    text = {
        "n": n,
        "stop_strs": _merged(_str_list(p + "stop", sp.get("stop")), _str_list(p + "stop_strs", sp.get("stop_strs"))),
        "stop_regex": regexes,
        "no_stop_trim": opt(sp, "no_stop_trim", bool, False, p),
        "skip_special_tokens": opt(sp, "skip_special_tokens", bool, True, p),
        "spaces_between_special_tokens": opt(sp, "spaces_between_special_tokens", bool, True, p),
        "stream_interval": stream_interval,
    }
    return out, text


def _logit_bias(name: str, value: Any) -> Optional[dict[int, float]]:
    """SGLang's ``logit_bias``: an object from token id (a string, as JSON keys are) to an added logit."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"`{name}` must be an object mapping token ids to numbers.")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"`{name}` has the key {key!r}, which is not a token id.") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise BadRequest(f"`{name}[{key}]` must be a number, got {bias!r:.30}.")
        out[token] = float(bias)
    return out


def _merged(a: list[str], b: list[str]) -> list[str]:
    return a + [x for x in b if x not in a]


def check_unique_rids(rids: list[str]) -> None:
    """SGLang's check of one request's rids (``GenerateReqInput._validate_rid_uniqueness``): a rid
    given to two prompts of a batch is refused with its message."""
    if len(set(rids)) != len(rids):
        counts = Counter(rids)
        duplicates = [rid for rid, count in counts.items() if count > 1]
        raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}")


def _token_ids_logprob(value: Any, vocab_size: Optional[int]) -> list[int]:
    """One prompt's ``token_ids_logprob``, with SGLang's checks and messages
    (``TokenizerManager._validate_token_ids_logprob``; it checks them with or without ``return_logprob``)."""
    if not isinstance(value, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in value):
        raise BadRequest("token_ids_logprob must be a flat list of integers.")
    for token in value:
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise BadRequest(f"token_ids_logprob contains out-of-vocabulary token id {token}; "
                             f"valid range is [0, {vocab_size}).")
    return list(value)


def _per_item(body: dict[str, Any], name: str, typ: type, default: Any, batch: int, is_single: bool) -> list[Any]:
    """A top-level field that SGLang takes as a scalar or, for a batch, one value per prompt."""
    value = body.get(name)
    if isinstance(value, list) and not is_single:
        if len(value) != batch:
            raise BadRequest(f"`{name}` has {len(value)} entries; the batch has {batch} prompts.")
        return [default if v is None else _check_type(name, v, typ) for v in value]
    return [default if value is None else _check_type(name, value, typ)] * batch


def parse_generate(body: dict[str, Any], tokenizer: Any, vocab_size: Optional[int] = None) -> ParsedGenerate:
    """Validate a ``/generate`` body: single or batched prompts, ``n`` samples each, streaming or not
    (``vocab_size``: the model's, to check the token ids of ``token_ids_logprob``)."""
    check_fields(body, GENERATE_FIELDS, "/generate")
    _refuse_unsupported(body, _GENERATE_UNSUPPORTED, "")
    for name in _GENERATE_DP_RANK:
        if body.get(name) not in (None, 0):
            raise BadRequest(f"`{name}`={body[name]!r} does not exist: this server is a single data-parallel rank (0).")
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise BadRequest("Give either `text` or `input_ids`, not both.")
    if ids is not None:
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            prompts = [_token_list(f"input_ids[{i}]", p) for i, p in enumerate(ids)]
            is_single = False
        else:
            prompts, is_single = [_token_list("input_ids", ids)], True
    elif text is not None:
        if isinstance(text, str):
            texts, is_single = [text], True
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts, is_single = list(text), False
        else:
            raise BadRequest("`text` must be a string or a list of strings.")
        if tokenizer is None:
            raise BadRequest("`text` needs a tokenizer; this server has none, send `input_ids`.")
        prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    else:
        raise BadRequest("Either `text` or `input_ids` must be given.")
    if not prompts:
        raise BadRequest("The batch is empty; give at least one prompt.")
    for i, p in enumerate(prompts):
        if not p:
            raise BadRequest(f"Prompt {i} is empty; give at least one input token.")
    batch = len(prompts)

    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if is_single or len(sp) != batch:
            raise BadRequest(f"`sampling_params` is a list of {len(sp)}; it must hold one object per prompt ({batch}).")
        parsed_sp = [parse_sampling(s, f"sampling_params[{i}]") for i, s in enumerate(sp)]
    else:
        parsed_sp = [parse_sampling(sp)] * batch
    n = parsed_sp[0][1]["n"]
    if any(t["n"] != n for _, t in parsed_sp):
        raise BadRequest("`sampling_params.n` must be the same for every prompt of a batch.")

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(batch)] if not is_single else [uuid.uuid4().hex]
    elif isinstance(rid, str):
        rids = [rid] if is_single else [f"{rid}_{i}" for i in range(batch)]
    elif isinstance(rid, list) and not is_single and all(isinstance(r, str) for r in rid):
        if len(rid) != batch:
            raise BadRequest(f"`rid` has {len(rid)} entries; the batch has {batch} prompts.")
        rids = list(rid)
        check_unique_rids(rids)
    else:
        raise BadRequest("`rid` must be a string (or, for a batch, a list of strings).")

    return_logprob = _per_item(body, "return_logprob", bool, False, batch, is_single)
    start_len = _per_item(body, "logprob_start_len", int, -1, batch, is_single)
    top_num = _per_item(body, "top_logprobs_num", int, 0, batch, is_single)
    return_text = opt(body, "return_text_in_logprobs", bool, False)
    tid = body.get("token_ids_logprob")
    if tid is None or tid == []:
        token_ids = [None] * batch
    elif not is_single and isinstance(tid, list) and isinstance(tid[0], list):  # one list per prompt
        if len(tid) != batch:
            raise BadRequest(f"`token_ids_logprob` is a list of {len(tid)} lists; the batch has {batch} prompts.")
        token_ids = [_token_ids_logprob(t, vocab_size) or None for t in tid]
    elif not is_single and not isinstance(tid, list):  # SGLang wraps a batch's scalar: [[id]] per prompt
        token_ids = [_token_ids_logprob([tid], vocab_size)] * batch
    else:
        token_ids = [_token_ids_logprob(tid, vocab_size)] * batch

    items: list[GenItem] = []
    for b in range(batch):
        if not return_logprob[b]:
            start, top, tids = -1, 0, None  # SGLang ignores them without return_logprob
        else:
            start, top, tids = start_len[b], top_num[b], token_ids[b]
            if top < 0:
                raise BadRequest(f"`top_logprobs_num` must be >= 0, got {top}.")
            if start > len(prompts[b]):
                raise BadRequest(
                    f"logprob_start_len={start} is higher than the number of input tokens {len(prompts[b])}. "
                    "Please use a smaller logprob_start_len."
                )
        items += prompt_items(
            len(items), rids[b], prompts[b], parsed_sp[b],
            {"logprob_start_len": start, "top_logprobs_num": top, "token_ids_logprob": tids},
            return_logprob[b], return_text, opt(body, "return_prompt_token_ids", bool, False),
        )
    return ParsedGenerate(items=items, is_single=is_single and n == 1, stream=opt(body, "stream", bool, False))


def prompt_items(start: int, rid: str, input_ids: list[int], sampling: tuple[dict[str, Any], dict[str, Any]],
                 logprob: dict[str, Any], return_logprob: bool, return_text_in_logprobs: bool,
                 return_prompt_token_ids: bool) -> list[GenItem]:
    """The ``n`` items of one prompt (``sampling`` is :func:`parse_sampling`'s pair; ``n`` is in it):
    indices from ``start``, rids ``<rid>_<k>`` when ``n > 1`` (so a prefix abort reaches them all)."""
    engine_kw, text = sampling
    n = text["n"]
    return [
        GenItem(
            index=start + k, rid=rid if n == 1 else f"{rid}_{k}", request_rid=rid, input_ids=input_ids,
            sampling={**engine_kw, **logprob}, stop_strs=text["stop_strs"], stop_regex=text["stop_regex"],
            no_stop_trim=text["no_stop_trim"], skip_special_tokens=text["skip_special_tokens"],
            spaces_between_special_tokens=text["spaces_between_special_tokens"],
            stream_interval=text["stream_interval"], return_logprob=return_logprob,
            return_text_in_logprobs=return_text_in_logprobs, return_prompt_token_ids=return_prompt_token_ids,
        )
        for k in range(n)
    ]


# ---------------------------------------------------------------------------- engine requests


def stop_checker(item: GenItem, tokenizer: Any) -> Optional[Callable[[EngineRequest], Optional[str]]]:
    """The engine-thread check for stop strings and stop regexes, or None when there are none.

    The last few output tokens are decoded (enough to hold the longest stop string, as SGLang's
    ``stop_str_max_len``); a match there ends the request.
    """
    if not (item.stop_strs or item.stop_regex) or tokenizer is None:
        return None
    longest = max([len(tokenizer.encode(s, add_special_tokens=False)) for s in item.stop_strs] + [1])
    window = max(longest + 2, STOP_REGEX_WINDOW_TOKENS if item.stop_regex else 0)
    patterns = [re.compile(r) for r in item.stop_regex]
    skip = item.skip_special_tokens

    def check(req: EngineRequest) -> Optional[str]:
        tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=skip)
        for s in item.stop_strs:
            if s in tail:
                return s
        for pattern in patterns:
            if pattern.search(tail):
                return pattern.pattern
        return None

    return check


def engine_request(item: GenItem, tokenizer: Any, context_length: int, on_finish: Callable[[EngineRequest], None],
                   on_token: Optional[Callable[[EngineRequest], None]] = None) -> EngineRequest:
    """The ``EngineRequest`` for one item (``max_new_tokens`` null: up to the context length)."""
    kw = dict(item.sampling)
    if kw["max_new_tokens"] is None:
        kw["max_new_tokens"] = max(context_length - len(item.input_ids), 0)
    return EngineRequest(rid=item.rid, input_ids=item.input_ids, on_finish=on_finish, on_token=on_token,
                         stop_check=stop_checker(item, tokenizer), **kw)


# ---------------------------------------------------------------------------- responses


def output_text(req: EngineRequest, item: GenItem, tokenizer: Any, ids: Optional[list[int]] = None) -> str:
    """The decoded output, trimmed at the matched stop (token or string) unless ``no_stop_trim``."""
    if tokenizer is None:
        return ""
    ids = req.output_ids if ids is None else ids
    matched = (req.finish_reason or {}).get("matched") if (req.finish_reason or {}).get("type") == "stop" else None
    if isinstance(matched, int) and not item.no_stop_trim and ids and ids[-1] == matched:
        ids = ids[:-1]
    kwargs: dict[str, Any] = {"skip_special_tokens": item.skip_special_tokens}
    if not item.spaces_between_special_tokens:
        kwargs["spaces_between_special_tokens"] = False
    text = tokenizer.decode(ids, **kwargs)
    if isinstance(matched, str) and not item.no_stop_trim:
        if matched in item.stop_strs:
            cut = text.rfind(matched)  # the occurrence that ended it (an earlier one may precede min_new_tokens)
        else:
            hit = re.search(matched, text)
            cut = hit.start() if hit else -1
        if cut >= 0:
            text = text[:cut]
    return text


def _token_text(tokenizer: Any, token: int, with_text: bool) -> Optional[str]:
    return tokenizer.decode([token]) if with_text and tokenizer is not None else None


def _logprob_entries(values: list[Optional[float]], ids: list[int], tokenizer: Any, with_text: bool) -> list[list[Any]]:
    return [[lp, tok, _token_text(tokenizer, tok, with_text)] for lp, tok in zip(values, ids)]


def _top_entries(rows: list[Optional[list[tuple[float, int]]]], tokenizer: Any, with_text: bool) -> list[Any]:
    return [None if row is None else [[lp, tok, _token_text(tokenizer, tok, with_text)] for lp, tok in row] for row in rows]


def item_response(req: EngineRequest, item: GenItem, tokenizer: Any, current_version: Optional[str],
                  finished: bool = True, upto: Optional[int] = None) -> dict[str, Any]:
    """SGLang's ``/generate`` output object for one item (also each chunk of a stream).

    ``meta_info.weight_versions`` is SGLang 0.5.23's list of ``{"version", "start", "end"}`` spans
    over the output tokens; ``weight_version`` is the last span's version. ``upto`` limits the
    output to its first tokens (a stream chunk taken while the engine thread appends more).
    """
    n_out = len(req.output_ids) if upto is None else upto
    output_ids = req.output_ids[:n_out]
    spans = req.version_spans(current_version, n_out)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason if finished else None,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": n_out,
        "cached_tokens": req.cached_tokens,
        "e2e_latency": (req.finished_at or req.created_at) - req.created_at,
        "weight_version": spans[-1]["version"],
        "weight_versions": spans,
    }
    if item.return_logprob:
        with_text = item.return_text_in_logprobs
        start = item.sampling["logprob_start_len"]
        in_ids = req.input_ids[start:] if start >= 0 else []
        meta["input_token_logprobs"] = _logprob_entries(req.input_token_logprobs or [], in_ids, tokenizer, with_text)
        meta["output_token_logprobs"] = _logprob_entries(req.output_logprobs[:n_out], output_ids, tokenizer, with_text)
        meta["output_token_logprobs_length"] = n_out
        if item.sampling["top_logprobs_num"]:
            meta["input_top_logprobs"] = _top_entries(req.input_top_logprobs or [], tokenizer, with_text)
            meta["output_top_logprobs"] = _top_entries(req.output_top_logprobs[:n_out], tokenizer, with_text)
        if item.sampling["token_ids_logprob"] is not None:
            meta["input_token_ids_logprobs"] = _top_entries(req.input_token_ids_logprobs or [], tokenizer, with_text)
            meta["output_token_ids_logprobs"] = _top_entries(req.output_token_ids_logprobs[:n_out], tokenizer, with_text)
    out: dict[str, Any] = {"text": output_text(req, item, tokenizer, output_ids), "output_ids": output_ids, "meta_info": meta}
    if item.return_prompt_token_ids:
        out["prompt_token_ids"] = list(req.input_ids)
    return out

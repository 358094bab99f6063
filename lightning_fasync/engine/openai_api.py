"""OpenAI-compatible endpoints of the embedded engine: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, and ``/tokenize`` and ``/detokenize`` (also under ``/v1``).

Fields, response shapes and messages follow SGLang 0.5.23 (``srt/entrypoints/openai/protocol.py``,
``serving_completions.py``, ``serving_chat.py``). As SGLang does, a request becomes the items a
native ``/generate`` call would make (``protocol.parse_sampling`` validates the sampling fields),
runs through the server's ``Submitted``, and its response is built from SGLang's native output of
each item (``protocol.item_response``), with the weight-version ``metadata`` SGLang attaches.

Field policy: a field the engine implements is honoured; a field it cannot honour (grammars and
``response_format``, LoRA, multimodal input, hidden states, tool-call parsing) is
refused with a 400 naming it only when it asks for something (a non-default value); any other
field name is ignored, as SGLang's pydantic models ignore what they do not define (the official
client passes new OpenAI fields through). Errors have OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.

The chat endpoint renders ``messages`` (with ``tools``, assistant ``tool_calls`` and ``tool``
messages) through the tokenizer's chat template, but does not parse tool calls or reasoning out of
the output: the reply is plain ``content``, and ``tool_choice`` ``"required"`` or a named function
is refused.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import json
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Awaitable, Callable, ClassVar, Optional

import jinja2
from aiohttp import web
from tokenizers import decoders

from lightning_fasync.engine import protocol
from lightning_fasync.engine.protocol import BadRequest
from lightning_fasync.engine.http_common import ENGINE_KEY, ENGINE_WATCH_S, STATE_KEY, Submitted, failure_of, json_body

DEFAULT_MODEL_NAME = "default"  # SGLang's ``model`` when a request names none
_WHERE = "request"  # parse_sampling's name for the request in its messages (`request.top_p` ...)

# Request fields whose SGLang sampling_params name is the same: parse_sampling validates them and
# refuses the unsupported ones (grammars, watermark) when they are set.
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids", "stop_regex", "no_stop_trim",
    "ignore_eos", "skip_special_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "regex", "ebnf", "logit_bias", "custom_params", "watermark",
)
# Chat fields that default to the model's generation_config (SGLang's ``--sampling-defaults model``).
_MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# SGLang fields the engine does not implement: accepted at the default given, refused otherwise.
_UNSUPPORTED: dict[str, Any] = {
    "lora_path": None, "session_id": None, "session_params": None, "custom_logit_processor": None,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "images_config": None, "mm_processor_kwargs": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None,
}
_UNSUPPORTED_COMPLETION = {**_UNSUPPORTED, "suffix": None}
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED, "return_sampling_mask": False, "sampling_logprobs_mode": None,
    "return_flat_raw_output_top_logprobs": False, "return_input_ids_in_sglext": False,
    "return_output_ids_in_sglext": False, "video_config": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "use_audio_in_video": False,
    # OpenAI fields SGLang does not define (it ignores them) that ask for more than text out of a
    # chat template.
    "functions": None, "function_call": None, "audio": None, "prediction": None, "web_search_options": None,
}
_DP_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank")
# SGLang's chat message roles (``user`` and its generic roles); a role is matched case-insensitively.
_CHAT_ROLES = ("system", "user", "assistant", "tool", "function", "developer", "latest_reminder", "root")


# ------------------------------------------------------------------------------ errors


def _error_response(status: int, message: str, err_type: Optional[str] = None, param: Optional[str] = None,
                    code: Any = None) -> web.Response:
    """An error in OpenAI's shape; ``type`` defaults to SGLang's (``BadRequestError`` for a 400)."""
    return web.json_response({"error": _error_body(status, message, err_type, param, code)}, status=status)


def _error_body(status: int, message: str, err_type: Optional[str] = None, param: Optional[str] = None,
                code: Any = None) -> dict[str, Any]:
    """The ``error`` object (also a stream's error event); ``code`` defaults to the status."""
    return {
        "message": message,
        "type": err_type or ("BadRequestError" if status == 400 else HTTPStatus(status).name),
        "param": param,
        "code": status if code is None else code,
    }


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _openai_errors(handler: _Handler) -> _Handler:
    """Answer a ``BadRequest`` raised by ``handler`` with a 400 in OpenAI's error shape."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error_response(400, str(exc))

    return wrapped


# ------------------------------------------------------------------------------ /v1/models


def _model_card(request: web.Request, name: str) -> dict[str, Any]:
    """SGLang's ``ModelCard`` of the served model."""
    return {
        "id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
        "parent": None, "max_model_len": request.app[ENGINE_KEY].context_length,
    }


async def list_models(request: web.Request) -> web.Response:
    """SGLang's ``ModelList``: the one served model."""
    card = _model_card(request, request.app[STATE_KEY]["served_model_name"])
    return web.json_response({"object": "list", "data": [card]})


async def retrieve_model(request: web.Request) -> web.Response:
    """The served model's card; 404 (SGLang's ``model_not_found`` error) for any other name."""
    name = request.match_info["model"]
    if name != request.app[STATE_KEY]["served_model_name"]:
        return _error_response(404, f"The model '{name}' does not exist", err_type="invalid_request_error",
                               param="model", code="model_not_found")
    return web.json_response(_model_card(request, name))


# ------------------------------------------------------------------------------ request fields


def _refuse_unsupported(body: dict[str, Any], table: dict[str, Any]) -> None:
    """Refuse a field of ``table`` set to more than its default, and a data-parallel rank other than 0."""
    for name, default in table.items():
        value = body.get(name)
        if value is not None and value != default and not (value in ([], {}, "") and default is None):
            raise protocol.unsupported(name, value, "null" if default is None else repr(default))
    for name in _DP_RANK_FIELDS:
        if body.get(name) not in (None, 0):
            raise BadRequest(f"`{name}`={body[name]!r} does not exist: this server is a single data-parallel rank (0).")


def _positive(body: dict[str, Any], name: str, default: Optional[int]) -> Optional[int]:
    """An optional integer field that must be at least 1 (SGLang's ``max_tokens`` check)."""
    value = protocol.opt(body, name, int, default)
    if value is not None and value <= 0:
        raise BadRequest(f"`{name}` must be positive, got {value}.")
    return value


def _sampling(body: dict[str, Any], max_new_tokens: Optional[int], extra: dict[str, Any],
              defaults: Optional[dict[str, Any]] = None) -> tuple[dict, dict]:
    """``parse_sampling`` of the request's sampling fields (SGLang's ``to_sampling_params`` mapping);
    ``defaults`` fill the fields the request leaves null."""
    sp = {**(defaults or {}), **{name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}}
    min_tokens = protocol.opt(body, "min_tokens", int, 0)
    if min_tokens < 0 or (max_new_tokens is not None and min_tokens > max_new_tokens):
        raise BadRequest(f"`min_tokens` must be in [0, max_tokens], got {min_tokens}.")
    sp.update(max_new_tokens=max_new_tokens, min_new_tokens=min_tokens,
              sampling_seed=protocol.opt(body, "seed", int, None), **extra)
    return protocol.parse_sampling(sp, _WHERE)


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage_stats)`` of ``stream_options``."""
    options = protocol.opt(body, "stream_options", dict, {})
    return (protocol.opt(options, "include_usage", bool, False, "stream_options."),
            protocol.opt(options, "continuous_usage_stats", bool, False, "stream_options."))


def _rids(body: dict[str, Any], batch: int, is_single: bool) -> tuple[str, list[str]]:
    """The response id and one request id per prompt, as ``/generate`` makes them from ``rid`` (a
    batch suffixes ``_<i>``; without ``rid``, a random one)."""
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    if isinstance(rid, str):
        return rid, [rid] if is_single else [f"{rid}_{i}" for i in range(batch)]
    if isinstance(rid, list) and len(rid) == batch and all(isinstance(r, str) for r in rid):
        protocol.check_unique_rids(rid)
        return rid[0], list(rid)
    raise BadRequest(f"`rid` must be a string or a list of {batch} strings (one per prompt).")


def _token_ids(name: str, value: Any) -> list[int]:
    """A prompt given as token ids (their range is the engine's check)."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadRequest(f"`{name}` must be a list of token ids.")
    return value


def _items(prompts: list[list[int]], rids: list[str], sampling: tuple[dict, dict], return_logprob: bool,
           top_logprobs: int, logprob_start_len: int, return_prompt_token_ids: bool) -> list[protocol.GenItem]:
    """The engine items: ``n`` samples of each prompt, rids ``<rid>_<k>`` when ``n > 1``."""
    logprob = {"logprob_start_len": logprob_start_len if return_logprob else -1,
               "top_logprobs_num": top_logprobs if return_logprob else 0, "token_ids_logprob": None}
    items: list[protocol.GenItem] = []
    for prompt, rid in zip(prompts, rids):
        items += protocol.prompt_items(len(items), rid, prompt, sampling, logprob, return_logprob, True,
                                       return_prompt_token_ids)
    return items


# ------------------------------------------------------------------------------ response pieces


def _finish(out: dict[str, Any]) -> tuple[Optional[str], Any]:
    """OpenAI's ``finish_reason`` and SGLang's ``matched_stop`` of one native output."""
    reason = out["meta_info"]["finish_reason"]
    return (reason["type"], reason.get("matched")) if reason else (None, None)


def _usage(outs: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """SGLang's ``UsageInfo``: the prompt counted once per prompt (every ``n``-th item)."""
    prompt = sum(outs[i]["meta_info"]["prompt_tokens"] for i in range(0, len(outs), n))
    completion = sum(out["meta_info"]["completion_tokens"] for out in outs)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}


def _weight_version_metadata(out: dict[str, Any]) -> dict[str, Any]:
    """SGLang's ``build_endpoint_weight_version_metadata`` (of the first item)."""
    meta = out["meta_info"]
    return {"weight_version": meta["weight_version"], "weight_versions": meta["weight_versions"]}


def _settled(text: str, stops: list[str]) -> str:
    """The part of an unfinished output's text that later tokens cannot change.

    Holds back an incomplete character (U+FFFD at the end) and a tail that may be the start of a
    stop string (trimmed away if the stop completes), so the streamed deltas add up to the final text.
    """
    text = text.rstrip("\ufffd")
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return text[:len(text) - held]


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet inverted: the character that stands for a byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(c): b for c, b in zip(printable + [256 + k for k in range(len(others))], printable + others)}


def _token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """OpenAI's ``bytes`` of a token: its text's UTF-8, except for a byte-level BPE token holding part
    of a multi-byte character (its text is U+FFFD), whose own bytes are recovered from its piece."""
    if "\ufffd" in text and tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and isinstance(backend.decoder, decoders.ByteLevel):
            piece, table = tokenizer.convert_ids_to_tokens(token_id), _byte_decoder()
            if piece and all(ch in table for ch in piece):
                return [table[ch] for ch in piece]
    return list(text.encode())


def _completion_logprobs(tokens: list[list[Any]], top: list[Any]) -> dict[str, Any]:
    """The completions ``logprobs`` object from native ``[logprob, id, text]`` entries.

    ``text_offset`` is -1 for every token, as SGLang reports it.
    """
    return {
        "text_offset": [-1] * len(tokens),
        "token_logprobs": [lp for lp, _, _ in tokens],
        "tokens": [text or "" for _, _, text in tokens],
        "top_logprobs": [None if row is None else {text or "": lp for lp, _, text in row} for row in top],
    }


def _chat_logprobs(tokenizer: Any, tokens: list[list[Any]], top: list[Any]) -> dict[str, Any]:
    """The chat ``logprobs`` object (``content``: one entry per token) from native entries."""

    def entry(lp: float, token_id: int, text: Optional[str]) -> dict[str, Any]:
        return {"token": text or "", "bytes": _token_bytes(tokenizer, token_id, text or ""), "logprob": lp}

    content = []
    for j, (lp, token_id, text) in enumerate(tokens):
        row = top[j] if j < len(top) else None
        content.append({**entry(lp, token_id, text), "top_logprobs": [entry(*alt) for alt in row or []]})
    return {"content": content}


# ------------------------------------------------------------------------------ calls


@dataclass
class _StreamState:
    """What the stream sent of one item: characters of text, output tokens (logprobs, ids)."""

    chars: int = 0
    tokens: int = 0
    started: bool = False


@dataclass
class _Call(abc.ABC):
    """A validated OpenAI request: the engine items and what its response carries."""

    chunk_object: ClassVar[str]  # the ``object`` of its stream chunks

    id: str
    model: str
    items: list[protocol.GenItem]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    tokenizer: Any
    created: int = field(default_factory=lambda: int(time.time()))

    @abc.abstractmethod
    def response(self, outs: list[dict[str, Any]]) -> dict[str, Any]:
        """The non-streamed response from the native outputs of all items."""

    @abc.abstractmethod
    def chunks(self, i: int, out: dict[str, Any], state: _StreamState, finished: bool) -> list[dict[str, Any]]:
        """The stream chunks for item ``i`` at its new (cumulative) native output ``out``."""

    def _chunk(self, choices: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def usage_chunk(self, outs: list[dict[str, Any]]) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the usage of all items."""
        return self._chunk([], _usage(outs, self.n))

    def _new_text(self, i: int, out: dict[str, Any], state: _StreamState, finished: bool) -> str:
        text = out["text"] if finished else _settled(out["text"], self.items[i].stop_strs)
        delta = text[state.chars:]
        state.chars = max(state.chars, len(text))
        return delta


@dataclass
class _CompletionCall(_Call):
    """A ``/v1/completions`` request."""

    chunk_object: ClassVar[str] = "text_completion"

    logprobs: Optional[int] = None
    echo: Optional[list[str]] = None  # the echoed text of each prompt
    return_token_ids: bool = False

    def _choice(self, i: int, out: dict[str, Any], text: str, first: bool, tokens: slice) -> dict[str, Any]:
        meta = out["meta_info"]
        reason, matched = _finish(out)
        echoed = first and self.echo is not None
        choice: dict[str, Any] = {
            "index": i, "text": (self.echo[i // self.n] if echoed else "") + text, "logprobs": None,
            "finish_reason": reason, "matched_stop": matched,
        }
        if self.logprobs is not None:
            token_lps, top_lps = meta["output_token_logprobs"][tokens], meta.get("output_top_logprobs", [])[tokens]
            if echoed and self.logprobs:  # the prompt's log-probs first (SGLang: echo with logprobs > 0)
                token_lps, top_lps = meta["input_token_logprobs"] + token_lps, meta["input_top_logprobs"] + top_lps
            choice["logprobs"] = _completion_logprobs(token_lps, top_lps)
        if self.return_token_ids:
            choice["token_ids"] = out["output_ids"][tokens]
            if first:
                choice["prompt_token_ids"] = out["prompt_token_ids"]
        return choice

    def response(self, outs: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [self._choice(i, out, out["text"], True, slice(None)) for i, out in enumerate(outs)],
            "usage": _usage(outs, self.n), "metadata": _weight_version_metadata(outs[0]),
        }

    def chunks(self, i: int, out: dict[str, Any], state: _StreamState, finished: bool) -> list[dict[str, Any]]:
        text = self._new_text(i, out, state, finished)
        n_tokens = out["meta_info"]["completion_tokens"]
        wants_tokens = self.logprobs is not None or self.return_token_ids
        first = not state.started
        if not (finished or text or (first and self.echo) or (wants_tokens and n_tokens > state.tokens)):
            return []
        choice = self._choice(i, out, text, first, slice(state.tokens, n_tokens))
        state.started, state.tokens = True, n_tokens
        usage = _usage([out], 1) if self.continuous_usage else None
        return [self._chunk([choice], usage)]


@dataclass
class _ChatCall(_Call):
    """A ``/v1/chat/completions`` request."""

    chunk_object: ClassVar[str] = "chat.completion.chunk"

    logprobs: bool = False
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False
    return_meta_info: bool = False

    def _logprobs(self, out: dict[str, Any], tokens: slice) -> Optional[dict[str, Any]]:
        if not self.logprobs:
            return None
        meta = out["meta_info"]
        return _chat_logprobs(self.tokenizer, meta["output_token_logprobs"][tokens],
                              meta.get("output_top_logprobs", [])[tokens])

    def response(self, outs: list[dict[str, Any]]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            reason, matched = _finish(out)
            choice: dict[str, Any] = {
                "index": i, "message": {"role": "assistant", "content": out["text"], "reasoning_content": None},
                "logprobs": self._logprobs(out, slice(None)), "finish_reason": reason, "matched_stop": matched,
            }
            if self.return_prompt_token_ids or self.return_token_ids:
                choice["prompt_token_ids"] = out["prompt_token_ids"]
            if self.return_token_ids:
                choice["response_token_ids"] = out["output_ids"]
            if self.return_meta_info:
                choice["meta_info"] = out["meta_info"]
            choices.append(choice)
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": choices, "usage": _usage(outs, self.n), "metadata": _weight_version_metadata(outs[0]),
        }

    def chunks(self, i: int, out: dict[str, Any], state: _StreamState, finished: bool) -> list[dict[str, Any]]:
        """SGLang's chat stream: a first chunk with the role, content deltas, a chunk with the
        ``finish_reason``. Log-probs ride on the chunk that carries their text (held-back tokens wait)."""
        chunks = []
        if not state.started:
            state.started = True
            chunks.append(self._delta(i, {"role": "assistant", "content": ""}))
        text = self._new_text(i, out, state, finished)
        n_tokens = out["meta_info"]["completion_tokens"]
        if text:
            usage = _usage([out], 1) if self.continuous_usage else None
            chunks.append(self._delta(i, {"content": text}, self._logprobs(out, slice(state.tokens, n_tokens)), usage))
            state.tokens = n_tokens
        if finished:
            reason, matched = _finish(out)
            left = self._logprobs(out, slice(state.tokens, n_tokens)) if n_tokens > state.tokens else None
            chunks.append(self._delta(i, {}, left, finish_reason=reason, matched_stop=matched))
        return chunks

    def _delta(self, i: int, delta: dict[str, Any], logprobs: Optional[dict[str, Any]] = None,
               usage: Optional[dict[str, Any]] = None, **finish: Any) -> dict[str, Any]:
        choice = {"index": i, "delta": {"reasoning_content": None, **delta}, "logprobs": logprobs,
                  "finish_reason": None, "matched_stop": None, **finish}
        return self._chunk([choice], usage)


# ------------------------------------------------------------------------------ /v1/completions


def _completion_prompts(prompt: Any, tokenizer: Any) -> tuple[list[list[int]], list[str], bool]:
    """``(token ids, echo texts, is_single)`` of each prompt of a completions request."""
    if not prompt or (isinstance(prompt, list) and all(isinstance(p, (str, list)) and not p for p in prompt)):
        raise BadRequest("Prompt cannot be empty")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)):
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if tokenizer is None:
            raise BadRequest("A text `prompt` needs a tokenizer; this server has none, send token ids.")
        ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        return ids, texts, isinstance(prompt, str)
    if not isinstance(prompt, list):
        raise BadRequest("`prompt` must be a string, a list of strings, a list of token ids or a list of lists "
                         "of token ids.")
    is_single = not isinstance(prompt[0], list)
    ids = [_token_ids("prompt", prompt)] if is_single else [_token_ids(f"prompt[{i}]", p) for i, p in enumerate(prompt)]
    decode = (lambda p: tokenizer.decode(p, skip_special_tokens=True)) if tokenizer is not None else (lambda p: "")
    return ids, [decode(p) for p in ids], is_single


def _parse_completion(body: dict[str, Any], tokenizer: Any) -> _CompletionCall:
    """Validate a ``/v1/completions`` body (SGLang's ``CompletionRequest``)."""
    _refuse_unsupported(body, _UNSUPPORTED_COMPLETION)
    if protocol.opt(body, "response_format", dict, {}).get("type", "text") != "text":
        raise protocol.unsupported("response_format", body["response_format"], "type 'text'")
    prompts, texts, is_single = _completion_prompts(body.get("prompt"), tokenizer)
    extra = {"json_schema": body["json_schema"]} if body.get("json_schema") is not None else {}
    sampling = _sampling(body, _positive(body, "max_tokens", 16), extra)
    n = sampling[1]["n"]
    best_of = protocol.opt(body, "best_of", int, n)
    if best_of != n:
        raise protocol.unsupported("best_of", best_of, f"null or n={n}")
    logprobs = protocol.opt(body, "logprobs", int, None)
    if logprobs is not None and logprobs < 0:
        raise BadRequest(f"`logprobs` must be >= 0, got {logprobs}.")
    echo = protocol.opt(body, "echo", bool, False)
    return_token_ids = protocol.opt(body, "return_token_ids", bool, False)
    call_id, rids = _rids(body, len(prompts), is_single)
    include_usage, continuous_usage = _stream_options(body)
    return _CompletionCall(
        id=call_id, model=protocol.opt(body, "model", str, DEFAULT_MODEL_NAME),
        items=_items(prompts, rids, sampling, logprobs is not None, logprobs or 0, 0 if echo and logprobs else -1,
                     return_token_ids),
        n=n, stream=protocol.opt(body, "stream", bool, False), include_usage=include_usage,
        continuous_usage=continuous_usage, tokenizer=tokenizer, logprobs=logprobs, echo=texts if echo else None,
        return_token_ids=return_token_ids,
    )


@_openai_errors
async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    call = _parse_completion(await json_body(request), request.app[STATE_KEY]["tokenizer"])
    return await _respond(request, call)


# ------------------------------------------------------------------------------ /v1/chat/completions


def _text_content(where: str, content: Any) -> str:
    """A message's content as text: text parts joined with spaces (SGLang's string content format)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"`{where}` must be a string or a list of content parts.")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
            raise BadRequest(f"Model only supports text input; received unsupported content type '{kind}' "
                             f"in `{where}`.")
        texts.append(part["text"])
    return " ".join(texts)


def _template_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as the chat template gets them (SGLang's ``_apply_jinja_template`` preparation):
    nulls dropped, text content, roles lower-cased, assistant tool-call arguments parsed from JSON."""
    if not isinstance(messages, list):
        raise BadRequest("`messages` must be a list of message objects.")
    if not messages:
        raise BadRequest("Messages cannot be empty.")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"`messages[{i}]` must be an object.")
        role = message.get("role")
        if not isinstance(role, str) or role.lower() not in _CHAT_ROLES:
            raise BadRequest(f"`messages[{i}].role` must be one of {', '.join(map(repr, _CHAT_ROLES))}, "
                             f"got {role!r:.40}.")
        msg = {k: v for k, v in message.items() if v is not None}
        msg.update(role=role.lower(), content=_text_content(f"messages[{i}].content", message.get("content")))
        if msg["role"] == "assistant" and isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_parsed_tool_call(f"messages[{i}].tool_calls[{j}]", call)
                                 for j, call in enumerate(msg["tool_calls"])]
        out.append(msg)
    return out


def _parsed_tool_call(where: str, call: Any) -> Any:
    """An assistant tool call with its JSON ``arguments`` string parsed, as SGLang hands templates."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"`{where}` must be an object with a `function` holding a `name`.")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        raise BadRequest("Assistant tool call function.arguments must be valid JSON.") from None
    if not isinstance(parsed, dict):
        raise BadRequest("Assistant tool call function.arguments must be a JSON object.")
    return {**call, "function": {**function, "arguments": parsed}}


def _chat_tools(body: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
    """The tools to render: none with ``tool_choice`` "none" (SGLang's default without tools)."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise BadRequest('`tools` must be a list of {"type": "function", "function": {"name": ...}} objects.')
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice not in ("none", "auto"):
        if isinstance(choice, str) and choice != "required":
            raise BadRequest(f"`tool_choice` must be 'none', 'auto', 'required' or a named function, "
                             f"got {choice!r:.40}.")
        raise BadRequest(
            f"`tool_choice`={choice!r:.80} is not supported by the embedded engine: tool-call parsing is not "
            "supported (the reply is plain content); use 'auto' or 'none' and read the calls from the content."
        )
    return tools if tools and choice != "none" else None


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """Extra chat-template variables: ``chat_template_kwargs`` and ``reasoning_effort`` (which, as in
    SGLang, also sets ``thinking``/``enable_thinking`` unless given)."""
    kwargs = dict(protocol.opt(body, "chat_template_kwargs", dict, {}))
    if "chat_template" in kwargs:
        raise BadRequest("Request-supplied chat_template is not allowed.")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, (str, int, float)) or isinstance(effort, bool):
            raise BadRequest(f"`reasoning_effort` must be a string or a number, got {effort!r:.40}.")
        kwargs.setdefault("thinking", effort != "none")
        kwargs.setdefault("enable_thinking", effort != "none")
        kwargs["reasoning_effort"] = effort
    return kwargs


def _chat_prompt(body: dict[str, Any], tokenizer: Any, add_generation_prompt: Optional[bool] = None,
                 add_special_tokens: bool = False) -> list[int]:
    """The prompt ids: ``input_ids`` as given, or the messages rendered by the chat template.

    As SGLang: the template's text is encoded without special tokens (the template writes its own);
    a last assistant message becomes a user message, or with ``continue_final_message`` the start of
    the reply (its text appended after the generation prompt). ``add_generation_prompt`` given
    (``/tokenize``'s field): the messages are rendered as given, with it passed to the template, and
    encoded with ``add_special_tokens``.
    """
    messages = _template_messages(body.get("messages"))
    tools, template_kwargs = _chat_tools(body), _template_kwargs(body)
    if body.get("input_ids") is not None:
        return _token_ids("input_ids", body["input_ids"])
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("`messages` cannot be rendered: the model's tokenizer has no chat template "
                         "(send `input_ids`, or a prompt to /v1/completions).")
    prefix = None
    continue_final = protocol.opt(body, "continue_final_message", bool, False)
    if continue_final and add_generation_prompt is False:
        raise BadRequest("continue_final_message needs add_generation_prompt to open the assistant turn.")
    if messages[-1]["role"] == "assistant" and (add_generation_prompt is None or continue_final):
        if continue_final:
            prefix = messages.pop()["content"]
        else:
            messages[-1] = {"role": "user", "content": messages[-1]["content"]}
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt is not False, **template_kwargs)
    except (jinja2.TemplateError, TypeError) as exc:
        raise BadRequest(f"The chat template failed on `messages`: {exc}") from None
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if prefix:
        ids += tokenizer(prefix, add_special_tokens=False)["input_ids"]
    return ids


def _model_sampling_defaults(model: Any) -> dict[str, Any]:
    """The sampling values the model's ``generation_config`` sets (SGLang's chat defaults)."""
    config = getattr(model, "generation_config", None)
    values = config.to_diff_dict() if config is not None else {}
    return {name: values[name] for name in _MODEL_DEFAULT_FIELDS if values.get(name) is not None}


def _parse_chat(body: dict[str, Any], tokenizer: Any, engine: Any) -> _ChatCall:
    """Validate a ``/v1/chat/completions`` body (SGLang's ``ChatCompletionRequest``)."""
    _refuse_unsupported(body, _UNSUPPORTED_CHAT)
    if any(m != "text" for m in protocol.opt(body, "modalities", list, [])):
        raise protocol.unsupported("modalities", body["modalities"], "['text']")
    if protocol.opt(body, "response_format", dict, {}).get("type", "text") != "text":
        raise protocol.unsupported("response_format", body["response_format"], "type 'text'")
    stream = protocol.opt(body, "stream", bool, False)
    flags = {name: protocol.opt(body, name, bool, False)
             for name in ("return_prompt_token_ids", "return_token_ids", "return_meta_info")}
    for name, on in flags.items():
        if stream and on:
            raise BadRequest(f"{name} is not supported with streaming. Please set stream=false when using {name}=true.")
    max_new_tokens = _positive(body, "max_completion_tokens", None) or _positive(body, "max_tokens", None)
    if max_new_tokens is not None and max_new_tokens > engine.context_length and not engine.allow_auto_truncate:
        raise BadRequest(f"max_completion_tokens is too large: {max_new_tokens}. "
                         f"This model supports at most {engine.context_length} completion tokens.")
    prompt = _chat_prompt(body, tokenizer)
    ctk = protocol.opt(body, "chat_template_kwargs", dict, {})
    sampling = _sampling(body, max_new_tokens,
                         {"spaces_between_special_tokens": ctk.get("spaces_between_special_tokens", True)},
                         _model_sampling_defaults(engine.model))
    top_logprobs = protocol.opt(body, "top_logprobs", int, 0)
    if top_logprobs < 0:
        raise BadRequest(f"`top_logprobs` must be >= 0, got {top_logprobs}.")
    logprobs = protocol.opt(body, "logprobs", bool, False)
    rid = _rids(body, 1, True)[0]
    include_usage, continuous_usage = _stream_options(body)
    return _ChatCall(
        id=rid, model=protocol.opt(body, "model", str, DEFAULT_MODEL_NAME),
        items=_items([prompt], [rid], sampling, logprobs, top_logprobs, -1,
                     flags["return_prompt_token_ids"] or flags["return_token_ids"]),
        n=sampling[1]["n"], stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
        tokenizer=tokenizer, logprobs=logprobs, **flags,
    )


@_openai_errors
async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    call = _parse_chat(await json_body(request), request.app[STATE_KEY]["tokenizer"], request.app[ENGINE_KEY])
    return await _respond(request, call)


# ------------------------------------------------------------------------------ running a call


async def _respond(request: web.Request, call: _Call) -> web.StreamResponse:
    """Submit the call's items, then answer with the response or, for ``stream``, its events."""
    run = Submitted(request, call.items, streaming=call.stream)
    failure = run.submit()
    if failure is None and call.stream:
        return await _stream(request, run, call)
    if failure is None:
        failure = await run.finish()
    if failure is not None:
        return _error_response(*failure)
    version = run.engine.weight_version
    outs = [protocol.item_response(req, item, call.tokenizer, version) for req, item in zip(run.reqs, run.items)]
    return web.json_response(call.response(outs))


async def _stream(request: web.Request, run: Submitted, call: _Call) -> web.StreamResponse:
    """Server-sent events as SGLang sends them: the call's chunks of each item as it progresses, a
    usage chunk with ``stream_options.include_usage``, then ``data: [DONE]``. A failed item ends
    the stream with an error event (the other items are cancelled)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    engine = run.engine
    states = [_StreamState() for _ in run.items]
    seen = [0] * len(run.items)  # tokens at the last chunk taken
    finals: dict[int, dict[str, Any]] = {}
    failure: Optional[tuple[int, str]] = None

    async def send(payload: dict[str, Any]) -> None:
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    try:
        while True:
            run.wake.clear()
            for i, (req, item) in enumerate(zip(run.reqs, run.items)):
                if i in finals:
                    continue
                if run.done[i].done():
                    failure = failure_of(req)
                    if failure is not None:
                        break
                    finals[i] = protocol.item_response(req, item, call.tokenizer, engine.weight_version)
                    for chunk in call.chunks(i, finals[i], states[i], finished=True):
                        await send(chunk)
                elif run.progress[i] > seen[i]:
                    seen[i] = run.progress[i]
                    out = protocol.item_response(req, item, call.tokenizer, engine.weight_version, finished=False,
                                                 upto=seen[i])
                    for chunk in call.chunks(i, out, states[i], finished=False):
                        await send(chunk)
            if failure is not None or len(finals) == len(run.items):
                break
            try:
                await asyncio.wait_for(run.wake.wait(), timeout=ENGINE_WATCH_S)
            except asyncio.TimeoutError:
                if not engine.alive:
                    failure = (503, "The engine stopped while the request was waiting.")
                    break
        if failure is not None:
            await run.cancel_unfinished()
            await send({"error": _error_body(*failure)})
        elif call.include_usage:
            await send(call.usage_chunk([finals[i] for i in range(len(run.items))]))
        await response.write(b"data: [DONE]\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        await asyncio.shield(run.cancel_unfinished())
        raise
    await response.write_eof()
    return response


# ------------------------------------------------------------------------------ /tokenize, /detokenize


def _tokenizer_of(request: web.Request, endpoint: str) -> Any:
    tokenizer = request.app[STATE_KEY]["tokenizer"]
    if tokenizer is None:
        raise BadRequest(f"{endpoint} needs a tokenizer; this server has none.")
    return tokenizer


@_openai_errors
async def tokenize(request: web.Request) -> web.Response:
    """SGLang's ``POST /tokenize`` (and ``/v1/tokenize``): ``prompt`` (a string or a list of them) or
    chat ``messages`` to token ids, as ``{"tokens", "count", "max_model_len"}`` (SGLang's
    ``TokenizeRequest``/``TokenizeResponse``, ``serving_tokenize.py``)."""
    body = await json_body(request)
    tokenizer = _tokenizer_of(request, "/tokenize")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("Exactly one of 'prompt' or 'messages' must be provided.")
    add_special_tokens = protocol.opt(body, "add_special_tokens", bool, True)
    if messages is not None:
        add_generation_prompt = protocol.opt(body, "add_generation_prompt", bool, None)
        # With add_generation_prompt, special tokens are added only when asked for explicitly.
        explicit = add_generation_prompt is not None and "add_special_tokens" in body and add_special_tokens
        tokens: Any = _chat_prompt({**body, "input_ids": None}, tokenizer, add_generation_prompt, explicit)
        count: Any = len(tokens)
    elif isinstance(prompt, str):
        tokens = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        count = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        tokens = [list(tokenizer.encode(p, add_special_tokens=add_special_tokens)) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        raise BadRequest(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")
    max_model_len = getattr(tokenizer, "model_max_length", -1)
    if isinstance(max_model_len, int) and not -(2**63) <= max_model_len < 2**64:  # HF's "no limit" sentinel
        max_model_len = request.app[ENGINE_KEY].context_length
    return web.json_response({"tokens": tokens, "count": count, "max_model_len": max_model_len})


@_openai_errors
async def detokenize(request: web.Request) -> web.Response:
    """SGLang's ``POST /detokenize`` (and ``/v1/detokenize``): ``tokens`` (a list of ids, or a list of
    such lists) to ``{"text"}`` (a string, or a list of them), ``skip_special_tokens`` by default."""
    body = await json_body(request)
    tokenizer = _tokenizer_of(request, "/detokenize")
    tokens = protocol.req(body, "tokens", list)
    skip = protocol.opt(body, "skip_special_tokens", bool, True)

    def ints(values: list[Any]) -> bool:
        return all(isinstance(t, int) and not isinstance(t, bool) for t in values)

    try:
        if not tokens:
            text: Any = ""
        elif isinstance(tokens[0], int) and not isinstance(tokens[0], bool):
            if not ints(tokens):
                raise BadRequest("Invalid input: 'tokens' must be a list of integers.")
            text = tokenizer.decode(tokens, skip_special_tokens=skip)
        elif isinstance(tokens[0], list):
            text = []
            for sub in tokens:
                if not isinstance(sub, list) or not ints(sub):
                    raise BadRequest(f"Invalid input: Sublist in 'tokens' must contain only integers. Found: {sub}")
                text.append(tokenizer.decode(sub, skip_special_tokens=skip))
        else:
            raise BadRequest(f"Invalid tokens type: {type(tokens[0])}. Expected List[int] or List[List[int]].")
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, BadRequest):
            raise
        return _error_response(400, f"Error decoding tokens: {exc}. Input tokens might be invalid for the model.",
                               err_type="DecodeError")
    return web.json_response({"text": text})


def add_routes(app: web.Application) -> None:
    """Register ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, and ``/tokenize`` and
    ``/detokenize`` (each also under ``/v1``)."""
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    for prefix in ("", "/v1"):
        app.router.add_post(prefix + "/tokenize", tokenize)
        app.router.add_post(prefix + "/detokenize", detokenize)

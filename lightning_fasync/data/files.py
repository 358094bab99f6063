"""Prompts from local dataset files: parquet, jsonl or json, read with Hugging Face ``datasets``.

``FileDataSource`` turns each record into a prompt for RL: the record's prompt (a string, or a
chat message list as in DAPO-Math-17k) goes through the tokenizer's chat template, and its ground
truth travels to the reward as ``sample.metadata["answer"]``. Order, epochs, recycling and the
checkpointed position are :class:`ListDataSource`'s; the state also records which file it was, so a
run cannot resume its position over a different one.

Two shapes the tests cover (``data_source.*`` keys in brackets)::

    DAPO-Math-17k  [prompt_key: prompt, answer_key: reward_model.ground_truth]
        {"prompt": [{"role": "user", "content": "..."}], "reward_model": {"ground_truth": "34"}, ...}
    GSM8K          [prompt_key: question, answer_key: answer]
        {"question": "...", "answer": "...reasoning...\\n#### 72"}   (the answer becomes "72")

The rendering helpers (:func:`chat_messages`, :func:`render_prompt`) and :func:`stop_token_ids`
are shared with :mod:`lightning_fasync.data.gym`. No hub access: ``datasets`` builds in a
temporary cache that is removed once the records are in memory.

A file ``datasets`` cannot read (empty, blank lines only, not UTF-8, a line that is not JSON, not
a parquet file, a parquet file without rows) is refused with a
:class:`~lightning_fasync.errors.ConfigError` that names the file, and the line where there is
one, rather than with the error ``datasets`` or pyarrow raised from inside.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from typing import Any, Optional, Sequence

from lightning_fasync.errors import ConfigError
from lightning_fasync.pipeline.datasource import ListDataSource

__all__ = ["FileDataSource", "chat_messages", "policy_stop_token_ids", "render_prompt", "stop_token_ids"]

# data_source.format -> the extensions it reads.
FORMATS: dict[str, tuple[str, ...]] = {
    "parquet": (".parquet",),
    "json": (".json", ".jsonl"),
    "jsonl": (".json", ".jsonl"),
}
# End-of-turn tokens of common chat templates (ChatML, Llama 3, Phi-3, Gemma).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# GSM8K: "reasoning...\n#### 72", or a bare "#### 72".
_GSM8K_ANSWER = re.compile(r"(?:^|\n)\s*####\s*(\S[^\n]*)\s*$")

Prompt = tuple[list[int], dict[str, Any]]


def chat_messages(
    prompt: Any, system_prompt: Optional[str] = None, where: str = "data_source.prompt_key"
) -> list[dict[str, Any]]:
    """A record's prompt as chat messages.

    Args:
        prompt: A string (one user message) or a list of ``{"role", "content"}`` messages.
        system_prompt: A system message put first, unless the messages already start with one.
        where: Names the prompt's origin in errors.

    Returns:
        The messages (null fields, which ``datasets`` adds when unifying a schema, removed).
    """
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
        if not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"The prompt at {where} has a message without a string `role` and `content`: {prompt!r:.200}.")
    else:
        raise ValueError(f"The prompt at {where} must be a string or a list of chat messages, not {prompt!r:.200}.")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _flat_ids(out: Any) -> list[int]:
    # transformers 4.x returns a list of ids; 5.x a BatchEncoding (a dict); either may be batched.
    if hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(t) for t in out]


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> tuple[list[int], str]:
    """Token ids and text of a prompt: the chat template with the generation prompt when the
    tokenizer has one, else the messages' contents joined with newlines.

    Args:
        tokenizer: A Hugging Face tokenizer.
        messages: Chat messages (see :func:`chat_messages`).

    Returns:
        ``(input_ids, text)``, the ids a flat list of ints.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        ids = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
        return _flat_ids(ids), str(text)
    text = "\n".join(m["content"] for m in messages)
    return _flat_ids(tokenizer(text)["input_ids"]), text


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The token ids that end a response: EOS, plus the chat template's end-of-turn token
    (``<|im_end|>``, ``<|eot_id|>``, ...) when the template uses it and the vocabulary has it.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        Distinct ids, EOS first.
    """
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        vocab = tokenizer.get_vocab()
        ids += [int(vocab[t]) for t in END_OF_TURN_TOKENS if t in template and t in vocab]
    return list(dict.fromkeys(ids))


def policy_stop_token_ids(tokenizer: Any, name_or_path: str | None = None) -> tuple[list[int], list[str]]:
    """The token ids that end the policy's responses: its tokenizer's EOS and its chat template's
    end-of-turn token (:func:`stop_token_ids`), then the ``eos_token_id`` of its
    ``generation_config.json`` (an id or a list, as transformers writes it) when ``name_or_path``
    is a local directory that has one.

    Returns:
        Distinct ids (the tokenizer's first) and, for each, its token as the tokenizer writes it.
    """
    ids = stop_token_ids(tokenizer)
    if name_or_path and os.path.isfile(os.path.join(name_or_path, "generation_config.json")):
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(name_or_path).eos_token_id
        ids += [int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None]
    ids = list(dict.fromkeys(ids))
    return ids, [repr(tokenizer.convert_ids_to_tokens(i)) for i in ids]


def keep_short(prompts: list[Prompt], max_prompt_length: Optional[int], owner: str) -> tuple[list[Prompt], int]:
    """Drop prompts longer than ``max_prompt_length`` tokens, saying how many on stderr.

    Returns:
        The prompts kept and the number dropped.

    Raises:
        ValueError: every prompt is too long.
    """
    if max_prompt_length is None:
        return prompts, 0
    kept = [p for p in prompts if len(p[0]) <= max_prompt_length]
    dropped = len(prompts) - len(kept)
    if dropped:
        print(
            f"{owner}: dropped {dropped} of {len(prompts)} prompts longer than {max_prompt_length} tokens "
            "(data_source.max_prompt_length)",
            file=sys.stderr,
        )
    if not kept:
        raise ValueError(
            f"{owner}: all {len(prompts)} prompts are longer than {max_prompt_length} tokens: raise "
            "`data_source.max_prompt_length`."
        )
    return kept, dropped


def _lookup(record: dict[str, Any], dotted: str, index: int, key: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            available = sorted(value) if isinstance(value, dict) else []
            raise KeyError(
                f"`{key}` is {dotted!r}, but record {index} has no {part!r} (available keys: {', '.join(available)})."
            )
        value = value[part]
    return value


def _answer_text(value: Any) -> str:
    if isinstance(value, str):
        match = _GSM8K_ANSWER.search(value)  # GSM8K: "reasoning...\n#### 72" (or "#### 72") -> "72"
        return match.group(1).strip() if match else value
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _resolve_files(path: str, format: Optional[str]) -> tuple[list[str], str]:
    if format is not None and format not in FORMATS:
        raise ValueError(
            f"`data_source.format` is {format!r}; supported: {', '.join(FORMATS)} (or null: from the extension)."
        )
    if not os.path.exists(path):
        raise FileNotFoundError(f"`data_source.path` {path!r} does not exist.")
    exts = FORMATS[format] if format else tuple(e for es in FORMATS.values() for e in es)
    if os.path.isdir(path):
        files = sorted(
            os.path.join(root, name) for root, _, names in os.walk(path) for name in names if name.endswith(exts)
        )
        if not files:
            raise FileNotFoundError(f"`data_source.path` {path!r} has no {'/'.join(sorted(set(exts)))} files.")
    else:
        files = [path]
    if format is None:
        kinds = {"parquet" if f.endswith(".parquet") else "json" if f.endswith((".json", ".jsonl")) else None for f in files}
        if None in kinds:
            raise ValueError(
                f"`data_source.path` {path!r} is not a .parquet, .jsonl or .json file: set `data_source.format` "
                f"({', '.join(FORMATS)})."
            )
        if len(kinds) > 1:
            raise ValueError(f"`data_source.path` {path!r} mixes parquet and json files: set `data_source.format`.")
        format = kinds.pop()
    return files, "json" if format == "jsonl" else format


def _first_line(exc: BaseException) -> str:
    """``Type: first sentence of the message`` (at most 200 characters)."""
    text = re.split(r"(?<=\.)\s|\n", str(exc).strip(), maxsplit=1)[0].rstrip(".")
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _parquet_problem(file: str) -> Optional[str]:
    """What makes ``file`` unreadable as parquet records, or None."""
    import pyarrow.parquet as pq

    if os.path.getsize(file) == 0:
        return "is empty (0 bytes), not a parquet file"
    try:
        rows = pq.ParquetFile(file).metadata.num_rows
    except Exception as exc:  # pyarrow's ArrowInvalid, OSError
        return f"is not a parquet file ({_first_line(exc)})"
    return "has no rows" if rows == 0 else None


def _json_problem(file: str) -> Optional[str]:
    """What makes ``file`` unreadable as JSON records (one object per line, or a JSON list of
    objects, or one object), or None."""
    with open(file, "rb") as fh:
        data = fh.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        return f"is not UTF-8 text: line {line} has the byte 0x{data[exc.start]:02x} at column {column}"
    if not text.strip():
        return "has only blank lines, no records" if text else "is empty (0 bytes), no records"
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as doc_error:
        lines = text.splitlines()
        first = next(i for i, line in enumerate(lines) if line.strip())
        try:
            json.loads(lines[first])
        except json.JSONDecodeError:  # not JSON lines: one document, broken
            return f"is not JSON: line {doc_error.lineno}, column {doc_error.colno}: {doc_error.msg}"
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"has a line that is not JSON: line {number}, column {exc.colno}: {exc.msg}"
            if not isinstance(record, dict):
                kind = type(record).__name__
                return f"has a line that is not a JSON object (a record): line {number} is {kind} {line.strip()[:40]!r}"
        return None
    if isinstance(whole, list):
        if not whole:
            return "holds an empty JSON list, no records"
        bad = next((i for i, record in enumerate(whole) if not isinstance(record, dict)), None)
        if bad is not None:
            return f"holds a JSON list whose item {bad} is not an object (a record) but {type(whole[bad]).__name__}"
    elif not isinstance(whole, dict):
        return f"holds a JSON {type(whole).__name__}, not records"
    return None


def _unreadable(files: list[str], builder: str, exc: BaseException) -> ConfigError:
    """The error for files ``datasets`` could not read: the first file found wrong, and why."""
    for file in files:
        try:
            problem = _parquet_problem(file) if builder == "parquet" else _json_problem(file)
        except OSError as err:
            problem = f"cannot be read ({_first_line(err)})"
        if problem:
            return ConfigError(f"`data_source.path` file {file!r} {problem}.")
    while exc.__cause__ is not None:  # datasets wraps the reader's error: say that one
        exc = exc.__cause__
    named = repr(files[0]) if len(files) == 1 else f"{files[0]!r} (and {len(files) - 1} more)"
    return ConfigError(f"`data_source.path` file {named} cannot be read as {builder} records ({_first_line(exc)}).")


def _read_records(files: list[str], builder: str, columns: list[str]) -> list[dict[str, Any]]:
    """The records of ``files``, read with ``datasets`` (in memory).

    Raises:
        ConfigError: A file is not readable as records (see :func:`_unreadable`).
    """
    import logging

    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    # datasets logs its reader's error before raising it; ours names the file and says it once.
    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with tempfile.TemporaryDirectory(prefix="fasync-datasets-") as cache:
            ds = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache, keep_in_memory=True)
        if ds.num_rows and all(c in ds.column_names for c in columns):
            ds = ds.select_columns(columns)  # only what is read: memory and time on large files
        # Strings are decoded here: pyarrow reads a non-UTF-8 file without complaint.
        return ds.to_list()
    except Exception as exc:  # StopIteration, UnicodeDecodeError, ArrowInvalid, DatasetGenerationError, ...
        raise _unreadable(files, builder, exc) from exc
    finally:
        log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


class FileDataSource(ListDataSource):
    """Prompts from a parquet, jsonl or json file (or a directory of them), rendered with the
    tokenizer's chat template.

    Each prompt's metadata is ``{"answer", "prompt_text", "dataset_index", "source"}``: the ground
    truth as a string (None without ``answer_key``; a GSM8K ``#### N`` answer becomes ``N``), the
    rendered prompt, the row in the file (files of a directory are read in sorted order) and the
    path's basename.

    Args:
        path: A file or a directory (``data_source.path``).
        tokenizer: The policy's Hugging Face tokenizer.
        prompt_key: Dotted path of the prompt in a record: a string or a chat message list.
        answer_key: Dotted path of the ground truth (e.g. ``reward_model.ground_truth``).
        system_prompt: A system message put first, unless the record's messages start with one.
        max_prompt_length: Drop prompts longer than this many tokens (``self.dropped_long`` counts them).
        format: ``parquet``, ``json`` or ``jsonl``; None: from the extension.
        shuffle: Permute each epoch.
        seed: Base seed of the per-epoch permutation.
        num_epochs: Stop after this many epochs (None: never).
    """

    def __init__(
        self,
        path: str,
        tokenizer: Any,
        prompt_key: str = "prompt",
        answer_key: Optional[str] = None,
        system_prompt: Optional[str] = None,
        max_prompt_length: Optional[int] = None,
        format: Optional[str] = None,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: Optional[int] = None,
    ) -> None:
        files, builder = _resolve_files(path, format)
        self.path = path
        self.source = os.path.basename(os.path.normpath(path))
        keys = [("data_source.prompt_key", prompt_key)] + ([("data_source.answer_key", answer_key)] if answer_key else [])
        records = _read_records(files, builder, list(dict.fromkeys(k.split(".")[0] for _, k in keys)))
        if not records:
            raise ValueError(f"`data_source.path` {path!r} has no records.")
        prompts: list[Prompt] = []
        for i, record in enumerate(records):
            prompt = _lookup(record, prompt_key, i, "data_source.prompt_key")
            messages = chat_messages(prompt, system_prompt, f"`data_source.prompt_key` {prompt_key!r} of record {i}")
            ids, text = render_prompt(tokenizer, messages)
            answer = _answer_text(_lookup(record, answer_key, i, "data_source.answer_key")) if answer_key else None
            prompts.append((ids, {"answer": answer, "prompt_text": text, "dataset_index": i, "source": self.source}))
        self.num_records = len(prompts)
        prompts, self.dropped_long = keep_short(prompts, max_prompt_length, type(self).__name__)
        super().__init__(prompts, shuffle=shuffle, seed=seed, num_epochs=num_epochs)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "source": self.source, "num_prompts": len(self._prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_identity(state, "source", self.source, len(self._prompts), "data_source.path", "the saved file")
        super().load_state_dict(state)


def check_identity(state: dict[str, Any], key: str, mine: Any, num_prompts: int, config_key: str, fix: str) -> None:
    """Refuse a saved position taken over other prompts (``state[key]`` and its prompt count differ):
    resuming it would replay some prompts and skip others."""
    saved = (state.get(key), state.get("num_prompts"))
    if saved != (mine, num_prompts):
        from lightning_fasync.pipeline.state import PipelineError  # state imports the datasource module

        raise PipelineError(
            f"The datasource was saved with {key} {saved[0]!r} ({saved[1]} prompts) and is now built with {mine!r} "
            f"({num_prompts} prompts) (`{config_key}`); resuming would break exactly-once prompt order: use {fix}."
        )

"""The embedded engine's Prometheus metrics, under SGLang 0.5.23's names (``srt/observability/
metrics_collector.py``): what SGLang exports where the engine has the quantity, written in
Prometheus' text exposition format (0.0.4) by hand, as ``prometheus_client`` would write it
(a counter's ``# TYPE`` names it without ``_total``; no ``_created`` samples).

As in SGLang, the server answers ``GET /metrics`` only when started with ``--enable-metrics``.
Scheduler metrics carry SGLang's scheduler labels (``model_name``, ``engine_type``, ``tp_rank``,
``pp_rank``, ``moe_ep_rank``), request metrics its tokenizer labels (``model_name``,
``engine_type``, and ``is_streaming`` where SGLang has it). ``sglang:gen_throughput`` is the
generation rate since the previous scrape (SGLang's: over its last decode log interval).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# SGLang's default buckets of sglang:e2e_request_latency_seconds.
E2E_LATENCY_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
                       2400)
STARTUP_PHASES = ("load_weight", "kv_cache_allocation", "scheduler_e2e", "tokenizer_e2e")


def _number(value: float) -> str:
    """A sample value or bucket bound as Prometheus' Go client (and ``prometheus_client``) write it."""
    value = float(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(value)


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, Any]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}" if labels else ""


class _Family:
    def __init__(self, name: str, kind: str, doc: str) -> None:
        self.name, self.kind, self.doc = name, kind, doc
        self.samples: list[tuple[str, dict[str, Any], float]] = []

    def add(self, value: float, labels: dict[str, Any], suffix: str = "") -> None:
        self.samples.append((suffix, labels, value))

    def text(self) -> str:
        base = self.name[: -len("_total")] if self.kind == "counter" and self.name.endswith("_total") else self.name
        lines = [f"# HELP {base} {self.doc}", f"# TYPE {base} {self.kind}"]
        for suffix, labels, value in self.samples:
            name = base + ("_total" if self.kind == "counter" else suffix)
            lines.append(f"{name}{_labels(labels)} {_number(value)}")
        return "\n".join(lines) + "\n"


class RequestMetrics:
    """Counters and the latency histogram of finished requests (SGLang's tokenizer metrics),
    observed on the server's event loop as each request finishes; read by the scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # By is_streaming ("true"/"false"): prompt tokens, generation tokens, requests, latency buckets.
        self.prompt_tokens: dict[str, int] = {}
        self.generation_tokens: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        self.aborted = 0
        self.latency_buckets: dict[str, list[int]] = {}
        self.latency_sum: dict[str, float] = {}
        self._last_scrape: Optional[tuple[float, int]] = None  # (time, engine's generated tokens)

    def observe(self, prompt_tokens: int, generation_tokens: int, e2e_latency: float, streaming: bool,
                aborted: bool) -> None:
        key = "true" if streaming else "false"
        with self._lock:
            self.prompt_tokens[key] = self.prompt_tokens.get(key, 0) + prompt_tokens
            self.generation_tokens[key] = self.generation_tokens.get(key, 0) + generation_tokens
            self.requests[key] = self.requests.get(key, 0) + 1
            buckets = self.latency_buckets.setdefault(key, [0] * len(E2E_LATENCY_BUCKETS))
            for i, bound in enumerate(E2E_LATENCY_BUCKETS):
                if e2e_latency <= bound:
                    buckets[i] += 1
            self.latency_sum[key] = self.latency_sum.get(key, 0.0) + e2e_latency
            if aborted:
                self.aborted += 1

    def throughput(self, generated_tokens: int, started_at: float) -> float:
        """Tokens per second generated since the previous call (the first: since ``started_at``)."""
        now = time.monotonic()
        with self._lock:
            then, before = self._last_scrape or (started_at, 0)
            self._last_scrape = (now, generated_tokens)
        return (generated_tokens - before) / (now - then) if now > then else 0.0


def render(engine: Any, metrics: RequestMetrics, model_name: str, startup_time: dict[str, Any],
           started_at: float) -> str:
    """The exposition text of one scrape: the engine's live state and the request counters."""
    scheduler = {"model_name": model_name, "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}
    tokenizer = {"model_name": model_name, "engine_type": "unified"}
    load, usage = engine.loads(), engine.memory_usage()
    capacity, used = load["max_total_num_tokens"], load["kv_used_tokens"]
    families: list[_Family] = []

    def gauge(name: str, doc: str, value: float, labels: dict[str, Any] = scheduler) -> None:
        family = _Family(name, "gauge", doc)
        family.add(value, labels)
        families.append(family)

    gauge("sglang:num_running_reqs", "The number of running requests.", load["num_running_reqs"])
    gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", load["num_waiting_reqs"])
    gauge("sglang:gen_throughput", "The generation throughput (token/s).",
          metrics.throughput(engine.generated_tokens, started_at))
    # The only cache across requests: aborted requests' kept caches (--keep-aborted-kv).
    looked_up = engine.prefill_tokens + engine.kept_kv_tokens
    gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", engine.kept_kv_tokens / looked_up if looked_up else 0.0)
    gauge("sglang:token_usage", "The token usage.", used / capacity if capacity else 0.0)
    gauge("sglang:num_used_tokens", "The number of used tokens.", used)
    gauge("sglang:kv_available_tokens", "Number of free token slots in the KV cache pool.", capacity - used)
    gauge("sglang:kv_used_tokens", "Number of actively used token slots in the KV cache pool.", used)
    gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", capacity)
    gauge("sglang:weight_memory_usage_gb", "Memory used by model weights in GB.", usage["weight"])
    gauge("sglang:kv_cache_memory_usage_gb", "Memory used by the KV cache pools in GB.", usage["kvcache"])
    gauge("sglang:page_size", "KV cache page size in tokens.", usage["kv_pool"]["page_size"])
    gauge("sglang:num_pages", "Number of KV cache pages.", usage["kv_pool"]["total_blocks"])
    gauge("sglang:context_len", "Maximum context length.", engine.context_length)
    retracted = _Family("sglang:num_retracted_requests_total", "counter", "Total number of retracted requests.")
    retracted.add(engine.decode_retractions, scheduler)
    families.append(retracted)

    startup = _Family("sglang:startup_time_seconds", "gauge", "Engine startup duration by phase in seconds.")
    for phase in STARTUP_PHASES:
        startup.add(float(startup_time.get(phase, 0.0)), {**tokenizer, "phase": phase})
    families.append(startup)
    with metrics._lock:
        keys = sorted(metrics.requests)
        for name, doc, table in (
            ("sglang:prompt_tokens_total", "Number of prefill tokens processed.", metrics.prompt_tokens),
            ("sglang:generation_tokens_total", "Number of generation tokens processed.", metrics.generation_tokens),
            ("sglang:num_requests_total", "Number of requests processed.", metrics.requests),
        ):
            family = _Family(name, "counter", doc)
            for key in keys:
                family.add(table.get(key, 0), {**tokenizer, "is_streaming": key})
            families.append(family)
        aborted = _Family("sglang:num_aborted_requests_total", "counter", "Number of requests aborted.")
        aborted.add(metrics.aborted, tokenizer)
        families.append(aborted)
        latency = _Family("sglang:e2e_request_latency_seconds", "histogram",
                          "Histogram of End-to-end request latency in seconds")
        for key in keys:
            labels = {**tokenizer, "is_streaming": key}
            for bound, count in zip(E2E_LATENCY_BUCKETS, metrics.latency_buckets[key]):
                latency.add(count, {**labels, "le": _number(bound)}, "_bucket")
            latency.add(metrics.requests[key], {**labels, "le": "+Inf"}, "_bucket")
            latency.add(metrics.requests[key], labels, "_count")
            latency.add(metrics.latency_sum[key], labels, "_sum")
        families.append(latency)
    return "".join(f.text() for f in families)


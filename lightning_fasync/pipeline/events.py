"""The event log and the ledger (docs/contract.md, "Observability").

- Event log: one JSON object per line, keys ``t``, ``event`` (dispatch | complete | collect |
  consume | train | pause | resume | sync), ``seq``, ``prompt``, ``R``, ``Q``, ``step``. ``train``
  (one training call) and ``sync`` carry ``dur``, their duration, and are written when they end.
  A live run and the simulator write the same format, so one timeline tool reads both. A run with
  its own engines also writes ``FAULT_EVENTS`` (engine and router faults, from the engine
  supervisor) with their own fields, among them ``wall`` (Unix time). A run with ``eval.*`` writes
  ``EVAL_EVENTS``: ``eval`` (an evaluation at a step boundary, with ``weight_version``, ``samples``
  and ``dur``, written when it ends).
- Ledger: one line per consumed group and per recycled or dropped prompt, so exactly-once
  consumption can be audited after a crash and resume.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Optional, TextIO

EVENTS = ("dispatch", "complete", "collect", "consume", "train", "pause", "resume", "sync")
FAULT_EVENTS = ("engine_dead", "engine_restarted", "engine_restart_failed", "engine_gave_up", "router_dead",
                "router_restart_failed", "router_restarted", "engine_fatal")
EVAL_EVENTS = ("eval",)

# One encoder for every line: json.dumps with non-default separators builds a new encoder per
# call, which dominated the cost of a step boundary that recycles hundreds of groups.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


class _JsonlWriter:
    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fh: Optional[TextIO] = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fh = open(path, "a", buffering=1 << 16)

    @property
    def enabled(self) -> bool:
        return self._fh is not None

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        line = _ENCODER.encode(record)
        with self._lock:
            if self._fh is not None:
                self._fh.write(line + "\n")

    def flush(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.flush()
                os.fsync(self._fh.fileno())

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.flush()
                self._fh.close()
                self._fh = None


class EventLog(_JsonlWriter):
    """JSONL event log; ``clock`` gives ``t`` (seconds; wall or virtual)."""

    def __init__(self, path: Optional[str], clock: Callable[[], float]) -> None:
        super().__init__(path)
        self.clock = clock

    def emit(self, event: str, *, seq: int = -1, prompt: Any = None, R: int = 0, Q: int = 0, step: int = 0, **extra: Any) -> None:
        fh = self._fh
        if fh is None:
            return
        if extra:
            record = {"t": round(self.clock(), 6), "event": event, "seq": seq, "prompt": None if prompt is None else str(prompt),
                      "R": R, "Q": Q, "step": step, **extra}
            self.write(record)
            return
        # The hot path (four events per group): the fixed schema formatted directly, which is the
        # same JSON the encoder writes for these types (a prompt id is "epoch:index").
        p = "null" if prompt is None else f'"{prompt}"'
        line = f'{{"t":{round(self.clock(), 6)!r},"event":"{event}","seq":{seq},"prompt":{p},"R":{R},"Q":{Q},"step":{step}}}\n'
        with self._lock:
            if self._fh is not None:
                self._fh.write(line)


class Ledger(_JsonlWriter):
    """JSONL ledger of what happened to each prompt: consume, recycle, drop."""

    def record(self, kind: str, **fields: Any) -> None:
        self.write({"kind": kind, **fields})


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Read a JSONL file, skipping a torn last line (a run killed mid-write)."""
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out

"""Driving the embedded engine in-process, for tests/engine/ (the engine, its KV pool)."""

from __future__ import annotations

import threading
import time

from lightning_fasync.engine.engine import EngineRequest


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Timed out after {timeout} s waiting for {what}.")
        time.sleep(0.001)


def submit(engine, rid, input_ids, **sampling) -> tuple[EngineRequest, threading.Event]:
    done = threading.Event()
    req = EngineRequest(rid=rid, input_ids=input_ids, on_finish=lambda r: done.set(), **sampling)
    engine.submit(req)
    return req, done

"""The collector: a background thread moving complete groups from TrajQueue to the PipelineBuffer.

Each pass asks the window strategy which completed groups may leave TrajQueue, applies the group
policy and ``rollout.filter``, and writes the rest to the buffer (all in
:meth:`PipelineState.collect_once`). It sleeps until the state's ``change_count`` moves.
"""

from __future__ import annotations

import threading
from typing import Optional

from lightning_fasync.pipeline.state import PipelineError, PipelineState


class Collector:
    """Runs :meth:`PipelineState.collect_once` whenever a collection decision could change."""

    def __init__(self, state: PipelineState) -> None:
        self.state = state
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._stopped = False

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="fasync-collector", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        state = self.state
        seen = -1
        try:
            while not self._stopping:
                with state.cond:
                    while state.change_count == seen and not self._stopping:
                        state.cond.wait(1.0)
                    seen = state.change_count
                if self._stopping:
                    return
                state.collect_once()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            state.set_error(exc)

    def stop(self, timeout: float = 30.0) -> None:
        """Idempotent."""
        if self._stopped:
            return
        self._stopping = True
        with self.state.cond:
            self.state.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise PipelineError(f"The collector thread did not stop within {timeout:.0f} s.")
        self._stopped = True

"""Preemption: SIGTERM (as Slurm and Kubernetes send it) or SIGINT ends a run cleanly, not silently.

On the first signal the run finishes the rollout step it is in, saves a checkpoint at that step
boundary (a consistent point: the pipeline state is taken inside the boundary), stops its engines
and exits with status 128 + signal (143 for SIGTERM, 130 for SIGINT), within
``trainer.preempt_grace_s``. A step that cannot finish in time is abandoned at the next wait the
pipeline makes (the last checkpoint stands; exactly-once accounting holds, as after a kill). A
second signal abandons at once. The handler only records the signal; everything else happens on
the main thread, at the points the step protocol reaches anyway.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """The run stopped on a signal; its exit status is 128 + the signal number."""


class Preemption:
    """Installs the SIGTERM/SIGINT handlers of one run and tells the step loop what to do.

    Arguments:
        grace_s: ``trainer.preempt_grace_s``.
        on_request: called (in the handler) on the first signal: the caller arranges a checkpoint
            at the coming step boundary (it should only set a flag).
        resume_hint: the checkpoint's path -> how the driver in use resumes from it, as the
            message's "resume with ..." says it (default: the CLI's ``--ckpt_path last``).
    """

    def __init__(self, grace_s: float, on_request: Optional[Callable[[], None]] = None,
                 resume_hint: Callable[[str], str] = lambda path: "`--ckpt_path last`") -> None:
        self.grace_s = grace_s
        self.on_request = on_request
        self.resume_hint = resume_hint
        self.signum: Optional[int] = None
        self.deadline = float("inf")
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        """Take over SIGTERM and SIGINT (main thread only; elsewhere Python allows no handlers)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Give the handlers back. Idempotent."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # a second signal: stop at the next check
            self.deadline = 0.0
            return
        self.signum = signum
        self.deadline = time.monotonic() + self.grace_s
        if self.on_request is not None:
            self.on_request()

    def check(self, last_checkpoint: Callable[[], Optional[str]] = lambda: None) -> None:
        """Abandon the step (raise :class:`Preempted`) once the grace period is over."""
        if self.signum is not None and time.monotonic() >= self.deadline:
            raise self.stop(None, last_checkpoint())

    def stop(self, saved: Optional[str], last: Optional[str] = None) -> Preempted:
        """The exception that ends the run, its message printed on stderr.

        Args:
            saved: the checkpoint written at this step boundary, or None when the step was abandoned.
            last: the checkpoint a resume starts from when nothing was saved now.
        """
        name = signal.Signals(self.signum).name if self.signum is not None else "a signal"
        if saved is not None:
            message = f"Interrupted by {name}: saved the checkpoint {saved}; resume with {self.resume_hint(saved)}."
        else:
            message = (
                f"Interrupted by {name}: the step did not finish within `trainer.preempt_grace_s` "
                f"({self.grace_s:g} s), so it was abandoned; "
                + (f"a resume with {self.resume_hint(last)} starts from {last}." if last
                   else "no checkpoint exists to resume from.")
            )
        print(message, file=sys.stderr, flush=True)
        return Preempted(128 + (self.signum or signal.SIGTERM))

"""Suite-wide set-up: under pytest-xdist each worker runs on cores of its own."""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    """Pin each pytest-xdist worker, and so every process its tests start, to its own share of the
    cores (``scripts/test`` runs 2 workers: one core each on a 2-core machine).

    A run started by a test splits the cores it sees between its trainer and engines
    (``lightning_fasync/fleet/resources.py``). Were both workers to see every core, two concurrent runs would
    put both trainers on one core and both engines on the other, and a torch op on two threads
    would wait for a thread the other worker's processes had preempted: on 2 cores the slow pass
    kept them 70-80 % busy that way and took 650-800 s; pinned, 85-90 % and ~540 s. A test that pins
    a process to named cores still can (a process may take any affinity the machine allows).
    ``LFA_TEST_PIN_WORKERS=0`` leaves every worker on every core. This runs before collection, so
    torch, imported by the test modules, sizes its thread pool to the worker's cores.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or workers < 2 or not hasattr(os, "sched_setaffinity"):
        return
    if os.environ.get("LFA_TEST_PIN_WORKERS", "1") == "0":
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        return  # fewer cores than workers: sharing is unavoidable
    per = len(cores) // workers
    index = int(worker[2:]) % workers  # a worker replacing a crashed one gets the next number
    os.sched_setaffinity(0, set(cores[index * per : (index + 1) * per]))

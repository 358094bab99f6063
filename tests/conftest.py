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


# The slow pass's files by their tests' time, longest first (seconds in a CI run of 2026-12-07 with
# the floors installing beside it, each file's slow tests summed; rounded). ``scripts/test`` keeps
# this order (--no-loadscope-reorder): pytest-xdist's own puts files with the most tests first,
# which left the single long tests (a LoRA fit, 81 s) for last, with one core idle for about a
# minute. The rest follow in collection order; a stale figure costs time, not correctness.
LONGEST_FIRST = {
    "tests/integration/test_engine_faults.py": 203, "tests/integration/test_gpu_all.py": 180,
    "tests/agents/test_tool_agent_flow.py": 147, "tests/integration/test_resume.py": 119, "tests/test_plan.py": 111,
    "tests/trainer_packing/test_ranks.py": 80, "tests/lora/test_fit.py": 77, "tests/weights/test_sync.py": 74,
    "tests/integration/test_megatron_fit.py": 67, "tests/runtime/test_preemption.py": 67,
    "tests/integration/test_synchronous.py": 65, "tests/integration/test_benchmarks.py": 64,
    "tests/integration/test_fit.py": 62, "tests/fleet/test_backends.py": 61,
    "tests/integration/test_sglang_compat.py": 55, "tests/integration/test_sharded_fit.py": 54,
    "tests/fleet/test_client.py": 46, "tests/trainers/megatron/test_training.py": 43,
    "tests/integration/test_parity_smoke.py": 37, "tests/lightning/test_fabric_ranks.py": 35,
    "tests/trainers/fsdp/test_sharding.py": 34, "tests/integration/test_tasks_fit.py": 32,
    "tests/trainers/megatron/test_checkpoint.py": 32, "tests/lightning/test_ddp.py": 32,
    "tests/integration/test_examples.py": 29, "tests/lora/test_benchmark.py": 23,
}


def pytest_collection_modifyitems(session, config, items) -> None:
    """Longest files first (:data:`LONGEST_FIRST`), each file's tests kept together and in order."""
    root = str(config.rootpath)

    def seconds(item) -> int:
        return LONGEST_FIRST.get(os.path.relpath(str(item.path), root), 0)

    items.sort(key=lambda item: -seconds(item))  # stable: the others keep collection order

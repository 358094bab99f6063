"""EngineSupervisor.stop says which of its threads outlived the timeout instead of returning as if
they had stopped."""

import threading
import types
import warnings

import pytest

from lightning_fasync.fleet.supervisor import EngineSupervisor


def test_a_restart_thread_that_outlives_stop_is_named_and_a_second_stop_is_harmless():
    sup = EngineSupervisor.__new__(EngineSupervisor)  # only what stop() reads
    sup._stop, sup._thread = threading.Event(), None
    release = threading.Event()
    worker = threading.Thread(target=release.wait, args=(10,), name="fasync-restart-0")
    worker.start()
    sup._workers = [worker]
    try:
        with pytest.warns(UserWarning, match=r"threads fasync-restart-0 did not stop within 0\.1 s; the pool stops its "
                                              r"processes under them"):
            sup.stop(timeout=0.1)
        assert sup._stop.is_set()
    finally:
        release.set()
        worker.join(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sup.stop(timeout=0.1)  # stopped by now: nothing to say


def test_a_replica_whose_run_stopped_while_it_joined_is_not_put_back():
    from lightning_fasync.fleet.pool import RolloutPool

    stopping = threading.Event()
    calls = []

    class Handle:
        url = "http://127.0.0.1:1"

        def wait_healthy(self, *args, **kwargs):
            calls.append("healthy")

        def stop(self):
            calls.append("stopped")

        def kill_tree(self):
            pass

    async def join(url):
        stopping.set()  # the run ends while the replica takes the weights
        return 7

    pool = RolloutPool.__new__(RolloutPool)  # only what restart_replica reads
    pool.servers = [Handle()]
    pool.startup_timeout, pool.api_key, pool.sync_lock = 1.0, None, threading.RLock()
    pool._relaunch = lambda index, port: Handle()
    pool._join = join
    pool.router_add = lambda url: calls.append("router")
    pool.workers = types.SimpleNamespace(add=lambda url: calls.append("workers"))
    assert pool.restart_replica(0, should_stop=stopping.is_set) is None
    assert "router" not in calls and "workers" not in calls and calls[-1] == "stopped"

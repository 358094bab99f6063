"""A weight sync or memory call waits for the engine pool's sync lock at most ``admin_timeout``."""

import threading
import types

import pytest

from lightning_fasync.pipeline.state import PipelineError
from lightning_fasync.runtime.rollout_runtime import RolloutRuntime


def _runtime(pool, admin_timeout):
    rt = RolloutRuntime.__new__(RolloutRuntime)  # only what _pool_lock reads
    rt.pool, rt.admin_timeout = pool, admin_timeout
    return rt


def test_a_lock_held_by_a_restart_past_admin_timeout_fails_the_call_and_a_free_one_is_taken():
    pool = types.SimpleNamespace(sync_lock=threading.RLock())
    rt = _runtime(pool, 0.2)
    held, release = threading.Event(), threading.Event()

    def restart():  # a replica restart joining, the lock held throughout
        with pool.sync_lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        assert held.wait(10)
        with pytest.raises(PipelineError, match=r"^The weight sync of step 3 waited 0.2 s \(the driver's admin_timeout\) "
                                                r"for the engine pool's sync lock, which a replica or router restart"):
            with rt._pool_lock("The weight sync of step 3"):
                pytest.fail("entered without the lock")
    finally:
        release.set()
        thread.join(10)
    with rt._pool_lock("The weight sync of step 4"):  # free again: taken, and released after
        assert pool.sync_lock._is_owned()
    assert not pool.sync_lock._is_owned()
    with _runtime(None, 0.2)._pool_lock("no pool"):  # a client of the caller's own: no lock to wait for
        pass

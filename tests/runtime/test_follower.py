"""The other ranks' half of the step (runtime/follower.py): the table replayed in rank 0's order,
the trainer moved only under colocate_offload and only when it is not there already, and the
weight sync's stream drained on every rank, also when the push fails."""

import pytest
import torch

from lightning_fasync.runtime.follower import FOLLOWER_TABLE, DriverHooks, Follower
from lightning_fasync.weights.tensor_stream import TensorStream


class Recorder(DriverHooks):
    def __init__(self, stream=None, runtime=None):
        self.calls, self.stream, self.runtime = [], stream, runtime
        driver = self

        class Hooks:
            def onload_train(self, optimizers):
                driver.calls.append(("onload_train", tuple(optimizers)))

            def offload_train(self, optimizers):
                driver.calls.append(("offload_train", tuple(optimizers)))

            def engine_state_dict(self):
                driver.calls.append(("engine_state_dict",))
                return driver.stream if driver.stream is not None else {"w": torch.zeros(1)}

        self.hooks = Hooks()

    def _driver_hooks(self):
        return self.hooks

    def _driver_optimizers(self):
        return ["opt"]


def _stream(n=3):
    tensors = {f"t{i}": torch.full((2,), float(i)) for i in range(n)}
    return TensorStream.from_mapping(tensors)


def _run(offload, points):
    driver = Recorder()
    follower = Follower(driver, offload)
    saved = []
    for point in points:
        follower.replay(point, save=lambda: saved.append(point))
    return [c[0] for c in driver.calls if c[0] != "engine_state_dict"], saved


def test_a_run_of_two_steps_under_colocate_offload_moves_the_trainer_as_rank_0_does():
    points = ["first_sync", "start", "batch", "save", "sync", "batch", "sync"]
    moved, saved = _run(True, points)
    # first_sync: on the device; start: off; each step: on before the first call, off before the sync.
    assert moved == ["offload_train", "onload_train", "offload_train", "onload_train", "offload_train"]
    assert saved == ["save"]


def test_without_offload_nothing_moves():
    moved, _ = _run(False, ["first_sync", "start", "batch", "save", "sync"])
    assert moved == []


def test_the_sync_drains_a_sharded_modules_stream_on_every_follower_point():
    stream = _stream()
    driver = Recorder(stream=stream)
    Follower(driver, False).replay("sync")
    assert stream.consumed == len(stream.specs)


def test_an_unknown_point_and_a_save_without_its_save_are_refused():
    follower = Follower(Recorder(), False)
    with pytest.raises(ValueError, match="'flush' is not a point of the step protocol"):
        follower.replay("flush")
    with pytest.raises(ValueError, match="needs the driver's save"):
        follower.replay("save")


def test_rank_0s_sync_drains_what_a_failed_push_left():
    class FailingRuntime:
        def sync_weights(self, weights, version):
            next(iter(weights))  # one tensor taken, then the engines fail
            raise RuntimeError("engine lost")

    stream = _stream()
    driver = Recorder(stream=stream, runtime=FailingRuntime())
    with pytest.raises(RuntimeError, match="engine lost"):
        driver.sync_weights(1)
    assert stream.consumed == len(stream.specs)  # the other ranks' gathers are matched


def test_the_table_lists_rank_0s_points_in_order():
    assert list(FOLLOWER_TABLE) == ["first_sync", "start", "batch", "save", "sync"]


def test_the_colocate_stages_need_the_runtime_on_rank_0_only():
    with pytest.raises(RuntimeError, match="Only global rank 0 holds the rollout runtime"):
        Recorder().offload_rollout()

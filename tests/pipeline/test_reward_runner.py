"""RewardRunner: rewards off the event loop, with timeouts, failure counters, and hung thread/process
handling (math_reward itself: tests/data/test_rewards.py)."""

import asyncio
import multiprocessing
import os
import time

import pytest

from lightning_fasync.data.rewards import math_reward
from lightning_fasync.pipeline.reward_runner import RewardError, RewardRunner
from lightning_fasync.types import TrajectoryStatus
from tests.helpers.rewards import GSM8K, make


# Module-level rewards: process mode pickles them by reference (the workers import this module).


def _slow(sample, traj):
    time.sleep(0.5)
    return 0.5


def _short(sample, traj):
    time.sleep(0.25)
    return 0.25


def _boom(sample, traj):
    raise ValueError("no answer in response")


def _pid_or_hang(sample, traj):
    if sample.metadata.get("hang"):
        time.sleep(60)
    return float(os.getpid())


def _hang(sample, traj):
    time.sleep(60)
    return 1.0


def _text_length(sample, traj):
    return float(len(traj.metadata["response_text"]))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------------- RewardRunner, threads


def test_sync_reward_runs_off_the_event_loop():
    runner = RewardRunner(_slow, timeout_s=10)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        tick = asyncio.create_task(ticker())
        reward = await runner(*make("1"))
        tick.cancel()
        return reward, ticks

    try:
        reward, ticks = asyncio.run(main())
    finally:
        runner.close()
    assert reward == 0.5
    assert ticks >= 5  # the loop kept running while the reward slept for 0.5 s


def test_async_reward_and_its_timeout():
    async def good(sample, traj):
        await asyncio.sleep(0.01)
        return 1

    async def hangs(sample, traj):
        await asyncio.sleep(60)

    async def own_timeout(sample, traj):
        raise TimeoutError("judge server timed out")

    async def main():
        assert await RewardRunner(good, timeout_s=5)(*make("1")) == 1.0
        runner = RewardRunner(hangs, timeout_s=0.3)
        with pytest.raises(RewardError, match="data_source.reward_timeout"):
            await runner(*make("1"))
        assert runner.metrics() == {"rollout/reward_failed": 1.0, "rollout/reward_timeout": 1.0}
        runner = RewardRunner(own_timeout, timeout_s=5)
        with pytest.raises(RewardError, match="TimeoutError: judge server timed out"):
            await runner(*make("1"))
        assert runner.metrics() == {"rollout/reward_failed": 1.0, "rollout/reward_timeout": 0.0}

    asyncio.run(main())


def test_hung_thread_times_out_and_later_calls_still_run():
    # One thread: the hung call's thread is abandoned and a spare takes the next call.
    calls = []

    def reward(sample, traj):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(60)  # abandoned (a daemon thread: it does not block interpreter exit)
        return 1.0

    runner = RewardRunner(reward, timeout_s=0.5, threads=1)

    async def main():
        t0 = time.monotonic()
        with pytest.raises(RewardError, match="data_source.reward_timeout") as err:
            await runner(*make("1"))
        elapsed = time.monotonic() - t0
        assert "0.5 s" in str(err.value) and "data_source.reward" in str(err.value)
        assert runner.stuck_threads == 1
        assert await asyncio.wait_for(runner(*make("1")), 5) == 1.0
        return elapsed

    try:
        elapsed = asyncio.run(main())
    finally:
        runner.close()
    assert 0.45 <= elapsed < 3
    assert runner.timeouts == 1 and runner.errors == 0
    assert runner.metrics() == {"rollout/reward_failed": 1.0, "rollout/reward_timeout": 1.0}
    assert runner.metrics() == {"rollout/reward_failed": 0.0, "rollout/reward_timeout": 0.0}  # reset on read


def test_raising_reward_is_counted_as_failed():
    runner = RewardRunner(_boom, timeout_s=5)

    async def main():
        for _ in range(2):
            with pytest.raises(RewardError, match="ValueError: no answer in response"):
                await runner(*make("1"))

    try:
        asyncio.run(main())
    finally:
        runner.close()
    assert runner.metrics() == {"rollout/reward_failed": 2.0, "rollout/reward_timeout": 0.0}


def test_queued_calls_do_not_time_out_while_waiting_for_a_thread():
    # 4 calls of 0.25 s on one thread take 1 s; each is within its own 0.6 s budget.
    runner = RewardRunner(_short, timeout_s=0.6, threads=1)

    async def main():
        return await asyncio.gather(*(runner(*make("1")) for _ in range(4)))

    try:
        assert asyncio.run(main()) == [0.25] * 4
    finally:
        runner.close()
    assert runner.timeouts == 0


def test_tokenizer_decode_sets_response_text():
    from lightning_fasync.policy import build_char_tokenizer

    tok = build_char_tokenizer()
    text = r"So \boxed{\frac{1}{2}} it is."
    sample, traj = make("0.5")
    traj.extend(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id], [0.0] * (len(text) + 1), [0] * (len(text) + 1))
    runner = RewardRunner(math_reward, timeout_s=30, tokenizer=tok)
    try:
        assert asyncio.run(runner(sample, traj)) == 1.0
    finally:
        runner.close()
    assert traj.metadata["response_text"] == text  # EOS skipped


def test_flow_marks_a_timed_out_reward_failed():
    from lightning_fasync.pipeline.flow import SingleTurnFlow

    runner = RewardRunner(lambda s, t: time.sleep(60), timeout_s=0.2)
    flow = SingleTurnFlow(client=None, sampling=None, max_response_length=8, reward_fn=runner)  # type: ignore[arg-type]
    sample, traj = make("1", "x")
    traj.status = TrajectoryStatus.COMPLETED
    try:
        asyncio.run(flow._score(sample, traj))
    finally:
        runner.close()
    assert traj.status is TrajectoryStatus.FAILED and traj.reward is None
    assert "data_source.reward_timeout" in traj.error


def test_close_is_idempotent_and_refuses_later_calls():
    runner = RewardRunner(_slow, timeout_s=5)
    runner.close()
    runner.close()
    with pytest.raises(RewardError, match="closed"):
        asyncio.run(runner(*make("1")))


# ---------------------------------------------------------------------------- RewardRunner, processes


def test_process_mode_refuses_unpicklable_or_async_rewards():
    with pytest.raises(ValueError, match="data_source.reward_processes"):
        RewardRunner(lambda s, t: 1.0, processes=1)

    async def judge(sample, traj):
        return 1.0

    with pytest.raises(ValueError, match="data_source.reward_processes"):
        RewardRunner(judge, processes=1)


def test_hung_worker_process_is_killed_and_replaced():
    runner = RewardRunner(_pid_or_hang, timeout_s=0.5, processes=2)

    async def main():
        first = await runner(*make("1"))
        # A hung call next to normal ones: only the hung one fails, the others are not resubmitted
        # or failed with it.
        results = await asyncio.gather(
            runner(*make("1", hang=True)), *(runner(*make("1")) for _ in range(4)), return_exceptions=True
        )
        after = await runner(*make("1"))
        return first, results, after

    try:
        first, results, after = asyncio.run(main())
        assert isinstance(results[0], RewardError) and "data_source.reward_timeout" in str(results[0])
        assert all(isinstance(r, float) for r in results[1:])
        assert isinstance(first, float) and isinstance(after, float)
        assert runner.timeouts == 1 and runner.errors == 0
        assert runner.metrics() == {"rollout/reward_failed": 1.0, "rollout/reward_timeout": 1.0}
        live = runner.worker_pids()
        assert 1 <= len(live) <= 2 and all(_alive(pid) for pid in live)
    finally:
        runner.close()
        runner.close()
    assert not any(_alive(pid) for pid in live)
    assert not multiprocessing.active_children()


def test_killed_worker_pid_no_longer_exists():
    runner = RewardRunner(_pid_or_hang, timeout_s=0.5, processes=1)

    async def main():
        before = int(await runner(*make("1")))
        with pytest.raises(RewardError, match="data_source.reward_timeout"):
            await runner(*make("1", hang=True))
        after = int(await runner(*make("1")))
        return before, after

    try:
        before, after = asyncio.run(main())
        assert not _alive(before)
        assert after != before and runner.worker_pids() == [after]
    finally:
        runner.close()
    assert not _alive(after)


def test_raising_reward_in_a_process_is_counted():
    runner = RewardRunner(_boom, timeout_s=10, processes=1)
    try:
        with pytest.raises(RewardError, match="ValueError: no answer in response"):
            asyncio.run(runner(*make("1")))
    finally:
        runner.close()
    assert runner.metrics() == {"rollout/reward_failed": 1.0, "rollout/reward_timeout": 0.0}


def test_math_reward_through_the_process_pool():
    from lightning_fasync.policy import build_char_tokenizer

    tok = build_char_tokenizer()
    runner = RewardRunner(math_reward, timeout_s=60, processes=1, tokenizer=tok)

    def scored(answer, text):
        sample, traj = make(answer)
        ids = tok.encode(text, add_special_tokens=False)
        traj.extend(ids, [0.0] * len(ids), [0] * len(ids))
        return runner(sample, traj)

    async def main():
        return await asyncio.gather(scored("0.5", r"\boxed{\frac{1}{2}}"), scored(GSM8K, "Answer: 72"), scored("3", r"\boxed{4}"))

    try:
        assert asyncio.run(main()) == [1.0, 1.0, 0.0]
    finally:
        runner.close()


def test_close_kills_workers_even_while_a_call_hangs():
    runner = RewardRunner(_pid_or_hang, timeout_s=30, processes=1)

    async def main():
        pid = int(await runner(*make("1")))  # the worker is up
        call = asyncio.ensure_future(runner(*make("1", hang=True)))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        runner.close()
        with pytest.raises(RewardError, match="closed"):
            await asyncio.wait_for(call, 10)
        return pid, time.monotonic() - t0

    pid, elapsed = asyncio.run(main())
    assert not _alive(pid)
    assert elapsed < 6
    assert not multiprocessing.active_children()

"""An engine call run on the producer's loop that outlasts its timeout is a PipelineError naming it,
on every Python the project supports (3.10's concurrent.futures.TimeoutError is not the builtin)."""

import asyncio
import threading

import pytest

from lightning_fasync.pipeline.producer import RolloutProducer
from lightning_fasync.pipeline.state import PipelineError


def test_a_call_that_outlasts_its_timeout_is_a_pipeline_error_and_is_cancelled():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    producer = RolloutProducer.__new__(RolloutProducer)  # only what run_coroutine reads
    producer.loop, producer._stopped = loop, False
    cancelled = threading.Event()

    async def hung():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        with pytest.raises(PipelineError, match=r"^An engine call on the producer loop did not return within 0.2 s\.$"):
            producer.run_coroutine(hung(), 0.2)
        assert cancelled.wait(5)  # and it does not go on running on the loop
        assert producer.run_coroutine(asyncio.sleep(0, result="done"), 5) == "done"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()

"""finish_in_thread: a worker thread's move is awaited to its end even by a cancelled caller, whose result is then
handed to ``abandoned`` (the hand-offs' landing memory goes back only when no byte can still arrive in it)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.stages.threads import finish_in_thread


def test_a_cancelled_caller_waits_for_the_thread_and_gives_its_result_back():
    ended, abandoned = threading.Event(), []

    def move() -> str:
        time.sleep(0.2)
        ended.set()
        return "slot"

    async def scenario() -> None:
        caller = asyncio.ensure_future(finish_in_thread(move, abandoned.append))
        await asyncio.sleep(0.05)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert ended.is_set(), "the cancellation went on only once the thread had ended"

    asyncio.run(scenario())
    assert abandoned == ["slot"]
    assert asyncio.run(finish_in_thread(lambda: 7, abandoned.append)) == 7 and abandoned == ["slot"]

"""The stage engine driver: steps run off the event loop; a failing step fails its waiters instead of hanging them."""

from __future__ import annotations

import asyncio

from services.runtime import EngineDriver


def test_failing_step_fails_waiters_and_the_loop_goes_on():
    async def scenario():
        work = ["poison", "good"]
        results, failures = [], []

        def step():
            item = work.pop(0)
            if item == "poison":
                raise RuntimeError("kernel failure")
            return item

        driver = EngineDriver(step, lambda: bool(work), results.append, failures.append)
        driver.poke()
        for _ in range(100):
            if results:
                break
            await asyncio.sleep(0.01)
        return results, failures

    results, failures = asyncio.run(scenario())
    assert results == ["good"]
    assert [type(e).__name__ for e in failures] == ["RuntimeError"]

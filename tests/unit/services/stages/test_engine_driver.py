"""The stage engine driver: steps run off the event loop; a failing step fails its waiters instead of hanging them."""

from __future__ import annotations

import asyncio

from services.stages.driver import EngineDriver


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


def test_awaited_engine_routes_results_fails_waiters_and_cancels_leavers():
    from services.stages.driver import AwaitedEngine

    async def scenario():
        queue: list[str] = []
        cancelled: list[str] = []

        def step():
            rid = queue.pop(0)
            if rid == "poison":
                raise RuntimeError("bad input")
            return [(rid, rid.upper())]

        def cancel(rid):
            cancelled.append(rid)
            if rid in queue:
                queue.remove(rid)

        runner = AwaitedEngine(step, lambda: bool(queue), lambda out: out, cancel)
        assert await runner.run("now", lambda: "immediate") == "immediate"
        ok = await runner.run("a", lambda: queue.append("a"))
        queue.append("held")  # never stepped before its caller gives up
        waiter = asyncio.ensure_future(runner.run("slow", lambda: None))
        await asyncio.sleep(0.05)
        waiter.cancel()
        failed = None
        try:
            await runner.run("poison", lambda: queue.insert(0, "poison"))
        except Exception as exc:
            failed = exc
        return ok, failed, cancelled, runner.waiting

    ok, failed, cancelled, waiting = asyncio.run(scenario())
    assert ok == "A"
    assert failed is not None and failed.http_status == 500
    assert "slow" in cancelled and "poison" in cancelled
    assert waiting == {}

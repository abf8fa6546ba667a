"""The stage engine driver: steps run off the event loop; a failing step fails its waiters instead of hanging them."""

from __future__ import annotations

import asyncio

from services.stages.driver import UNHEALTHY_AFTER, EngineDriver


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


def test_an_engine_failing_steps_in_a_row_reports_unhealthy_and_one_good_step_heals_it():
    import pytest

    from services.stages.driver import check_engines

    async def scenario() -> list[int]:
        work = ["bad"] * UNHEALTHY_AFTER + ["good", "bad"]
        seen: list[int] = []

        def step():
            item = work.pop(0)
            if item == "bad":
                raise RuntimeError("the device is gone")
            return item

        driver = EngineDriver(step, lambda: bool(work), lambda _: None, lambda _: seen.append(driver.failures))
        driver.poke()
        for _ in range(200):
            if not work:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return [*seen, driver.failures]

    counts = asyncio.run(scenario())
    assert counts == [1, 2, 3, 1, 1]  # three in a row; the good step reset the count; one more failure
    with pytest.raises(RuntimeError, match="failed its last 3 steps"):
        check_engines("encode", [0, UNHEALTHY_AFTER])
    check_engines("encode", [UNHEALTHY_AFTER - 1])


def test_the_decode_stage_reports_unhealthy_when_its_steps_keep_failing(model_cache, monkeypatch):
    """The decode engine ends the sequences of a failed step itself (the driver sees no exception): its own count of
    failed steps in a row is what the stage's health check reads — three sequences whose steps fail, and the replica
    reports unhealthy; no KV is left behind."""
    import pytest

    from common.engine.decode import DecodeEngine
    from common.protocol.sampling import SamplingParams
    from services.stages.decode import DecodeDeployment
    from tests.unit.common.engine.test_decode_engine import _prefilled

    d = DecodeDeployment({"model": {"model": "prism-tiny-llava", "cache_dir": model_cache, "torch_threads": 1}})
    d.check_health()
    monkeypatch.setattr(DecodeEngine, "_decode", lambda self, batch: (_ for _ in ()).throw(RuntimeError("gone")))
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(3):
        d.engine.submit(f"r{i}", _prefilled(d.lm, i, 0, sampling), sampling)
        events = d.engine.step()
        assert [e.finish_reason for e in events][-1] == "error"
    with pytest.raises(RuntimeError, match="decode engine failed its last 3 steps"):
        d.check_health()
    d.pool.check_no_leaks()


def test_every_stage_reports_its_queue_depth_and_the_engine_stages_their_health(model_cache):
    """Serve's autoscaling reads each stage's ``record_autoscaling_stats`` (:class:`QueueDepthPolicy`: a stage that
    reports nothing is scaled to its minimum) and replaces a replica whose ``check_health`` raises: a prefill replica
    whose lane keeps failing steps reports unhealthy, and an idle one a queue depth of 0."""
    import pytest

    from services.stages import decode, encode, media, prefill

    for cls in (media.MediaDeployment, encode.EncodeDeployment, prefill.PrefillDeployment, decode.DecodeDeployment):
        assert callable(getattr(cls, "record_autoscaling_stats", None)), cls.__name__
    for cls in (encode.EncodeDeployment, prefill.PrefillDeployment, decode.DecodeDeployment):
        assert callable(getattr(cls, "check_health", None)), cls.__name__
    model = {"model": "prism-tiny-llava", "cache_dir": model_cache, "torch_threads": 1}
    p = prefill.PrefillDeployment({"model": model})
    assert p.record_autoscaling_stats() == {"queue_depth": 0.0}
    p.check_health()
    p.lanes[0].runner.driver.failures = UNHEALTHY_AFTER
    with pytest.raises(RuntimeError, match="prefill engine failed its last 3 steps"):
        p.check_health()


def test_a_result_whose_caller_left_is_handed_to_orphaned():
    """The engine finished a request whose caller had gone (its step was already running): the result is not
    dropped unseen but handed to ``orphaned`` — prefill gives its exported KV's staging memory back there."""
    from services.stages.driver import AwaitedEngine

    async def scenario():
        started, release, orphans = asyncio.Event(), asyncio.Event(), []
        loop = asyncio.get_running_loop()
        queue: list[str] = []

        def step():  # (in a worker thread: holds the step until the caller is gone)
            loop.call_soon_threadsafe(started.set)
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(5)
            return [(queue.pop(0), "kv")]

        runner = AwaitedEngine(step, lambda: bool(queue), lambda out: out, lambda rid: None, orphaned=orphans.append)
        waiter = asyncio.ensure_future(runner.run("gone", lambda: queue.append("gone")))
        await started.wait()
        waiter.cancel()
        await asyncio.sleep(0)
        release.set()
        for _ in range(100):
            if orphans:
                break
            await asyncio.sleep(0.01)
        return orphans

    assert asyncio.run(scenario()) == ["kv"]

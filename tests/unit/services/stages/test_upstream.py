"""A call sent before its upstream finished: the upstream's result once it exists, its typed errors as they were
raised, and a lost upstream replica as a lost hand-off — never as an actor death Serve would pin on this replica."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from common.errors import HandoffLost, Overloaded
from services.stages.upstream import Pending, arrived


def _settles(value=None, error: BaseException | None = None):
    async def later():
        await asyncio.sleep(0.01)
        if error is not None:
            raise error
        return value

    return later()


def _task_error(cause: BaseException) -> RayTaskError:
    return RayTaskError("Prefill.prefill", "Traceback (most recent call last): ...", cause).as_instanceof_cause()


def test_a_value_passes_and_a_pending_result_arrives():
    assert asyncio.run(arrived({"kv": 1})) == {"kv": 1}
    assert asyncio.run(arrived(Pending(_settles({"kv": 2}), "prefill"))) == {"kv": 2}


def test_the_upstreams_typed_error_comes_back_as_it_was_raised():
    refused = Overloaded("the prefill token budget is full", retry_after_s=2.0)
    with pytest.raises(Overloaded) as got:
        asyncio.run(arrived(Pending(_settles(error=_task_error(refused)), "prefill")))
    assert got.value is refused and not isinstance(got.value, RayTaskError)


@pytest.mark.parametrize(
    "raised", [ActorDiedError(), _task_error(ActorDiedError())], ids=["when-awaited", "inside-the-upstream-call"]
)
def test_a_lost_upstream_replica_is_a_lost_hand_off_not_an_actor_death(raised):
    with pytest.raises(HandoffLost, match="prefill replica was lost") as got:
        asyncio.run(arrived(Pending(_settles(error=raised), "prefill")))
    assert not isinstance(got.value, ActorDiedError)


def test_cancelled_while_it_waits_it_stops_waiting():
    async def run():
        never = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(arrived(Pending(never, "prefill")))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert never.cancelled()

    asyncio.run(run())


def test_a_waiting_call_whose_reservation_lapsed_still_counts_as_a_slot():
    """A ``generate`` sent early holds the request slot its reservation committed; if the reservation lapses while it
    waits, the replica must still count that slot, or it would grant reservations whose calls find none."""
    from types import SimpleNamespace

    from common.config import PrismConfig
    from common.errors import Overloaded
    from services.stages.decode import DecodeDeployment

    cfg = PrismConfig.model_validate({"deployments": {"decode": {"max_ongoing_requests": 4}}})
    reserved: set[str] = {"a"}
    replica = SimpleNamespace(
        cfg=cfg,
        grouped=False,
        queues={"s": None},  # one stream
        awaiting={"a", "b"},  # two calls waiting for their prefill: "a" still reserved, "b" lapsed
        engine=SimpleNamespace(num_reserved=len(reserved), is_reserved=lambda key: key in reserved),
        kv_admission=SimpleNamespace(retry_after_s=lambda n: 1.0),
    )
    with pytest.raises(Overloaded, match="3 of its 4 request slots"):
        DecodeDeployment._check_slots(replica)
    replica.awaiting = {"a"}
    DecodeDeployment._check_slots(replica)  # 2 committed: one more reservation fits

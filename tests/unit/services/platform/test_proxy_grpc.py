"""The gRPC guard, on Serve's own gRPC server (``ray.serve._private.grpc_util.start_grpc_server``, the function Serve's
gRPC proxy starts its server with), with the guard installed as the proxy start-up callback installs it: a call
without a valid ``authorization`` key is refused before its message reaches Serve's handler, and concurrent calls are
capped. Pinned to Ray's private names: this fails when Ray moves them."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from common.config import PrismConfig
from services.platform import proxy_grpc
from services.platform.proxy_guard import GuardSettings
from services.proto import prism_pb2, prism_pb2_grpc
from tests.netutil import free_port

KEY = "sk-grpc"


@pytest.fixture
def guarded():
    """The guard installed (then grpc.aio's server constructor put back)."""
    import grpc.aio._server as aio_server

    original = aio_server.Server.__init__
    cfg = PrismConfig.model_validate({"server": {"api_keys": {KEY: "alpha"}, "max_concurrent_grpc_calls": 1}})
    assert proxy_grpc.install(GuardSettings.of([("prism", "/", cfg)]))
    yield
    aio_server.Server.__init__ = original


def test_the_private_names_the_guard_needs_are_there():
    from ray.serve._private import grpc_util

    assert issubclass(grpc_util.gRPCGenericServer, grpc.aio._server.Server)
    assert callable(grpc_util.start_grpc_server)


def test_serves_grpc_server_refuses_a_call_without_a_key_before_its_handler_and_caps_calls(guarded):
    from ray.serve._private.grpc_util import start_grpc_server
    from ray.serve._private.proxy_request_response import gRPCStreamingType
    from ray.serve.config import gRPCOptions

    handled: list[bytes] = []
    release = asyncio.Event()

    def factory(service_method: str, streaming_type: gRPCStreamingType):
        async def unary_unary(request: bytes, context) -> bytes:
            handled.append(request)
            await release.wait()
            return prism_pb2.GenerateResponse(id="ok").SerializeToString()

        async def other(*args, **kwargs):
            raise AssertionError("not called in this test")

        return unary_unary if streaming_type == gRPCStreamingType.UNARY_UNARY else other

    port = free_port()
    options = gRPCOptions(
        port=port, grpc_servicer_functions=["services.proto.prism_pb2_grpc.add_PrismServicer_to_server"]
    )

    async def scenario() -> tuple:
        loop = asyncio.get_running_loop()
        _, server = await start_grpc_server(factory, options, event_loop=loop)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = prism_pb2_grpc.PrismStub(channel)
                request = prism_pb2.GenerateRequest(chat_completion_json="{}")
                refused = []
                for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", KEY),)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.Generate(request, metadata=metadata, timeout=10)
                    refused.append((info.value.code(), json.loads(info.value.details())["error"]["code"]))
                keyed = (("authorization", f"Bearer {KEY}"),)
                first = asyncio.ensure_future(stub.Generate(request, metadata=keyed, timeout=10))
                while not handled:
                    await asyncio.sleep(0.01)
                with pytest.raises(grpc.aio.AioRpcError) as busy:  # the cap is 1 call at once
                    await stub.Generate(request, metadata=keyed, timeout=10)
                release.set()
                answer = await first
                return refused, busy.value.code(), answer.id, len(handled)
        finally:
            await server.stop(0)

    refused, busy, answer, calls = asyncio.run(scenario())
    assert refused == [(grpc.StatusCode.UNAUTHENTICATED, "invalid_api_key")] * 3
    assert busy == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert answer == "ok" and calls == 1  # only the keyed call within the cap reached Serve's handler


def test_installing_twice_changes_nothing(guarded):
    from ray.serve._private.grpc_util import gRPCGenericServer

    init = gRPCGenericServer.__mro__[1].__init__
    assert proxy_grpc.install(GuardSettings.of([]))
    assert gRPCGenericServer.__mro__[1].__init__ is init

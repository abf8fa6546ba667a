"""``make serve``'s gRPC listeners: with ``PRISM_GRPC_HOST`` / ``PRISM_REPLICA_GRPC_HOST`` set, Serve's gRPC proxy and
each replica's inter-deployment gRPC server listen on that host instead of every interface (``[::]``)."""

from __future__ import annotations

import pytest

from services.platform import loopback


class _Server:
    def __init__(self) -> None:
        self.ports: list[str] = []

    def add_insecure_port(self, address: str) -> int:
        self.ports.append(address)
        return 1


@pytest.fixture
def ray_modules(monkeypatch):
    from ray.serve._private import default_impl, replica

    # monkeypatch restores whatever the patch under test replaces
    monkeypatch.setattr(default_impl, "add_grpc_address", default_impl.add_grpc_address)
    monkeypatch.setattr(replica, "add_port_to_grpc_server", replica.add_port_to_grpc_server)
    return default_impl, replica


@pytest.mark.parametrize(("host", "bound"), [("127.0.0.1", "127.0.0.1:9000"), ("::1", "[::1]:9000")])
def test_with_a_host_both_grpc_listeners_bind_it(ray_modules, monkeypatch, host, bound):
    default_impl, replica = ray_modules
    monkeypatch.setenv(loopback.ENV_GRPC_HOST, host)
    monkeypatch.setenv(loopback.ENV_REPLICA_GRPC_HOST, host)
    loopback.bind_grpc_proxy()
    loopback.bind_replica()
    patched = replica.add_port_to_grpc_server
    loopback.bind_replica()  # idempotent: a second deployment built in the same process wraps nothing twice
    assert replica.add_port_to_grpc_server is patched
    proxy, rep = _Server(), _Server()
    default_impl.add_grpc_address(proxy, "[::]:9000")  # what Serve's proxy asks for
    replica.add_port_to_grpc_server(rep, "[::]:9000")  # what a replica asks for
    assert proxy.ports == [bound] and rep.ports == [bound]


def test_without_a_host_serve_binds_as_it_would(ray_modules, monkeypatch):
    default_impl, replica = ray_modules
    monkeypatch.delenv(loopback.ENV_GRPC_HOST, raising=False)
    monkeypatch.delenv(loopback.ENV_REPLICA_GRPC_HOST, raising=False)
    loopback.bind_grpc_proxy()
    loopback.bind_replica()
    proxy, rep = _Server(), _Server()
    default_impl.add_grpc_address(proxy, "[::]:9000")
    replica.add_port_to_grpc_server(rep, "[::]:9000")
    assert proxy.ports == ["[::]:9000"] and rep.ports == ["[::]:9000"]


def test_make_serve_environment_keeps_replicas_on_loopback_whatever_the_proxies_bind():
    from services.cli import loopback_env

    env = loopback_env({"http_options": {"host": "127.0.0.1", "port": 8000}})
    assert env == {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        loopback.ENV_REPLICA_GRPC_HOST: "127.0.0.1",
        loopback.ENV_GRPC_HOST: "127.0.0.1",
    }
    assert loopback_env({})[loopback.ENV_GRPC_HOST] == "127.0.0.1"  # Serve's own default HTTP host
    exposed = loopback_env({"http_options": {"host": "0.0.0.0"}})  # a config that opens its proxies on purpose
    assert exposed[loopback.ENV_GRPC_HOST] == "0.0.0.0" and exposed[loopback.ENV_REPLICA_GRPC_HOST] == "127.0.0.1"

"""What the coordinator exposes by default: metrics on loopback, no reflection unless asked."""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from gradstar.config import CoordinatorSettings
from tests.integration.test_server import reflected_services

from .conftest import http_get


def metrics_address(hub) -> str:
    return hub._metrics_server.sockets[0].getsockname()[0]


async def test_metrics_bind_loopback_even_when_grpc_binds_every_interface(start_coordinator):
    # No token here: every interface needs --insecure (tests/runtime/test_cli_errors.py).
    hub = await start_coordinator(host="0.0.0.0", metrics_port=0, insecure=True)
    assert metrics_address(hub) == "127.0.0.1"
    status, _, _ = await http_get(hub.metrics_port, "/metrics")
    assert status == 200


async def test_metrics_host_opens_the_endpoint_to_other_hosts(start_coordinator):
    hub = await start_coordinator(metrics_port=0, metrics_host="0.0.0.0")
    assert metrics_address(hub) == "0.0.0.0"


def test_metrics_host_and_reflection_come_from_the_environment(monkeypatch):
    assert (CoordinatorSettings.model_fields["metrics_host"].default,
            CoordinatorSettings.model_fields["reflection"].default) == ("127.0.0.1", False)
    monkeypatch.setenv("GRADSTAR_METRICS_HOST", "0.0.0.0")
    monkeypatch.setenv("GRADSTAR_REFLECTION", "1")
    settings = CoordinatorSettings()
    assert (settings.metrics_host, settings.reflection) == ("0.0.0.0", True)


async def reflection_status(address: str) -> grpc.StatusCode:
    """The status a reflection call ends with when it sends nothing. With a request to write,
    a server that answers UNIMPLEMENTED at once races the client's write, and grpc-python then
    reports that write's failure (INTERNAL, "Failed execute_batch") instead of the status."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter(()), timeout=5)
        return await call.code()


async def test_reflection_is_off_unless_asked_for(start_coordinator):
    hub = await start_coordinator()
    assert await reflection_status(hub.address) == grpc.StatusCode.UNIMPLEMENTED

    hub = await start_coordinator(reflection=True)
    assert "gradstar.proto.v1.Rendezvous" in await reflected_services(hub.address)

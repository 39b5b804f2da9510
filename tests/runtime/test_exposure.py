"""What the coordinator exposes by default: metrics on loopback, no reflection unless asked."""

from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gradstar.config import CoordinatorSettings

from .conftest import http_get


def metrics_address(hub) -> str:
    return hub._metrics_server.sockets[0].getsockname()[0]


async def test_metrics_bind_loopback_even_when_grpc_binds_every_interface(start_coordinator):
    hub = await start_coordinator(host="0.0.0.0", metrics_port=0)
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


async def list_services(address: str) -> set[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request]), timeout=5):
            return {s.name for s in reply.list_services_response.service}
    return set()


async def test_reflection_is_off_unless_asked_for(start_coordinator):
    hub = await start_coordinator()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await list_services(hub.address)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED

    hub = await start_coordinator(reflection=True)
    assert "gradstar.proto.v1.Rendezvous" in await list_services(hub.address)

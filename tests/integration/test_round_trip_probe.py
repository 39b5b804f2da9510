"""A rank measures its round trip to a target in one round trip: the health checks whose
fastest answer is the round trip (:func:`gradstar.client.collective.connections.round_trip`)
are all in flight at once, so joining across 200 ms costs 0.2 s for it, not 0.6 s. Here a real
gRPC server on 127.0.0.1:0 answers a check only once every probe has arrived (in turn, the
first would wait for the others until its deadline), and one that never answers gives 0.0
(counted as near)."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradstar.client.collective import connections


class _Gate(health_pb2_grpc.HealthServicer):
    """Answers SERVING once ``wanted`` checks are in flight together; never, if None."""

    def __init__(self, wanted: int | None) -> None:
        self.wanted, self.in_flight, self.most = wanted, 0, 0
        self.all_in = asyncio.Event()

    async def Check(self, request, context):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.wanted is not None and self.in_flight >= self.wanted:
            self.all_in.set()
        try:
            if self.wanted is None:
                await asyncio.sleep(30)
            await self.all_in.wait()
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVING)
        finally:
            self.in_flight -= 1


async def _measure(gate: _Gate, timeout: float) -> float:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(gate, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 10)
            return await connections.round_trip(channel, (), timeout)
    finally:
        await server.stop(0)


async def test_the_probes_go_at_once_and_their_fastest_is_the_round_trip():
    gate = _Gate(connections.PROBES)
    rtt = await asyncio.wait_for(_measure(gate, 5.0), 30)
    assert gate.most == connections.PROBES  # in turn, one at a time: the first times out
    assert 0.0 < rtt < 5.0


async def test_a_target_that_answers_no_probe_counts_as_near():
    gate = _Gate(None)
    assert await asyncio.wait_for(_measure(gate, 0.3), 30) == 0.0

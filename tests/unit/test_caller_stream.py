"""The direct lane's blocking streams (gradstar.client.collective.caller_stream) against a real
gRPC server on 127.0.0.1:0: messages both ways, an OK end, a failed call's status and trailing
metadata, a cancel from another thread, and that the installed grpcio gets the caller-polled
kind (if a grpcio upgrade removed its segregated calls this fails instead of quietly slowing
every small collective down)."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent import futures

import grpc
import pytest

from gradstar.client.collective.caller_stream import (
    CallerStream,
    QueuedStream,
    caller_streams_supported,
    open_stream,
)

METHOD = "/test.Echo/Stream"
DEADLINE = 10.0


def _echo(requests, context):
    """Echo each message; b"end" ends the call OK, b"fail" aborts it with trailing metadata,
    b"hold" waits until the client cancels."""
    for message in requests:
        if message == b"end":
            return
        if message == b"fail":
            context.set_trailing_metadata((("gradstar-error", "LostRankError"),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "rank 1 is gone")
        if message == b"hold":
            deadline = time.monotonic() + DEADLINE
            while context.is_active() and time.monotonic() < deadline:
                time.sleep(0.01)
            return
        yield message


@pytest.fixture(scope="module")
def channel():
    server = grpc.server(futures.ThreadPoolExecutor(16))  # a thread per open stream
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(_echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(ch).result(timeout=DEADLINE)
    yield ch
    ch.close()
    server.stop(None)


def in_time(fn, *args):
    """Run ``fn`` on a thread with a deadline, so a hang fails the test."""
    with futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=DEADLINE)


def test_this_grpcio_gets_the_caller_polled_stream(channel):
    assert caller_streams_supported(channel)
    stream = open_stream(channel, METHOD, ())
    assert isinstance(stream, CallerStream)
    stream.close()


@pytest.mark.parametrize("kind", [CallerStream, QueuedStream])
def test_messages_round_trip_then_an_ok_end_reads_none(channel, kind):
    stream = kind(channel, METHOD, (("authorization", "Bearer t"),))
    for i in range(50):
        payload = bytes([i]) * (1 + i * 37)
        stream.send(payload)
        assert in_time(stream.read) == payload
    assert stream.usable
    stream.send(b"end")
    assert in_time(stream.read) is None
    assert not stream.usable
    stream.close()


@pytest.mark.parametrize("kind", [CallerStream, QueuedStream])
def test_a_failed_call_raises_its_status_and_trailing_metadata(channel, kind):
    stream = kind(channel, METHOD, ())
    stream.send(b"x")
    assert in_time(stream.read) == b"x"
    stream.send(b"fail")
    with pytest.raises(grpc.RpcError) as raised:
        in_time(stream.read)
    error = raised.value
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == "rank 1 is gone"
    assert dict(error.trailing_metadata())["gradstar-error"] == "LostRankError"
    assert not stream.usable
    stream.close()


@pytest.mark.parametrize("kind", [CallerStream, QueuedStream])
def test_end_from_another_thread_wakes_the_reader(channel, kind):
    stream = kind(channel, METHOD, ())
    stream.send(b"hold")
    why = RuntimeError("the session failed")
    threading.Timer(0.2, stream.end, (why,)).start()
    with pytest.raises(grpc.RpcError) as raised:
        in_time(stream.read)
    assert raised.value.code() is grpc.StatusCode.CANCELLED
    assert stream.ended_by is why and not stream.usable
    stream.close()


def test_close_frees_an_idle_stream_and_a_closed_one_can_be_closed_again(channel):
    streams = [CallerStream(channel, METHOD, ()) for _ in range(8)]
    for stream in streams:
        stream.send(b"ping")
        assert in_time(stream.read) == b"ping"
    for stream in streams:
        in_time(stream.close)
        assert not stream.usable
        in_time(stream.close)


class Interrupted(Exception):
    """What this test's SIGINT handler raises (not KeyboardInterrupt, which would stop pytest)."""


def _interrupt(signum, frame):
    raise Interrupted


def test_a_signal_while_waiting_interrupts_the_read_and_leaves_the_stream_closed(channel):
    # gRPC checks for signals every 200 ms while the caller waits in its completion queue;
    # a handler's exception ends the wait, and gRPC frees the call and its queue: the stream
    # must not poll that queue again (close() and usable must not touch it).
    stream = CallerStream(channel, METHOD, ())
    stream.send(b"hold")
    previous = signal.signal(signal.SIGINT, _interrupt)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(Interrupted):
            stream.read()  # on the main thread: only there does Python run signal handlers
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert not stream.usable
    in_time(stream.close)
    fresh = CallerStream(channel, METHOD, ())
    fresh.send(b"after")
    assert in_time(fresh.read) == b"after"
    fresh.close()

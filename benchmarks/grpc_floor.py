"""What moving bytes costs before gradstar adds anything: CPU-seconds per GB through raw TCP and
through gRPC-python, one way, on loopback or between two emulated hosts, by message size.

Why
    At 5-10 Gbit/s a 2-core host is CPU-bound, so an all_reduce's time follows its CPU per byte
    (docs/performance.md, "Fast links"). gradstar keeps gRPC as its transport; this measures the
    floor that choice sets, so that gradstar's own CPU per byte can be read as the transport's
    share plus gradstar's. A sender process streams ``--mb`` MiB in messages of ``--chunk-kb``
    KiB to a receiver process that only counts them (no protobuf, no checksum, no reduction:
    gRPC's generic handlers with bytes in and out), then answers once. The reference in the
    same run is a plain TCP socket (``sendall`` of the same messages, ``recv_into`` one buffer),
    about what gloo's transport pays. Both processes raise glibc's malloc thresholds as
    gradstar's do (:mod:`gradstar.allocator`; ``--default-allocator`` leaves them: then every
    received message of 512 KiB or more costs the receiver fresh pages, ~0.2-0.3 CPU-s/GB more).

What it prints
    Per transport and message size: GB/s, and CPU-seconds per GB of the sender, the receiver and
    both (each process's user + system CPU, all its threads, from the first byte to the
    answer), the median of ``--repeats`` runs; and each transport's CPU per GB as a multiple of
    TCP's in the same run.

How to reproduce
    .venv/bin/python benchmarks/grpc_floor.py           # 512 MiB transfers, 256 KiB-2 MiB messages
    .venv/bin/python benchmarks/grpc_floor.py --chunk-kb 512 --repeats 5 --json out.json
    sudo .venv/bin/python benchmarks/grpc_floor.py --rate 10gbit   # two emulated hosts
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

from gradstar.allocator import share_malloc_arena, tune_allocator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import environment, format_table, loadavg, median, write_json

MiB = 1 << 20
METHOD = "/floor.Sink/Take"
TRANSPORTS = ("tcp", "grpc-aio", "grpc-sync")


def cpu_now() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


#: More channel arguments for both ends (``--grpc-option NAME=INTEGER``), as the process sees them.
EXTRA_OPTIONS = [(name, int(value)) for name, value in (
    item.split("=", 1) for item in os.environ.get("GRPC_FLOOR_OPTIONS", "").split(",") if item)]


def channel_options(chunk: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", chunk + 4096),
            ("grpc.max_send_message_length", chunk + 4096), *EXTRA_OPTIONS]


# -- receivers: each prints its port, then one JSON line per transfer (its CPU) --------------

def receive_tcp(bind: str, total: int, chunk: int, repeats: int) -> None:
    server = socket.create_server((bind, 0))
    print(server.getsockname()[1], flush=True)
    buffer = memoryview(bytearray(chunk))
    for _ in range(repeats):
        conn, _ = server.accept()
        with conn:
            got, start = 0, None
            while got < total:
                n = conn.recv_into(buffer)
                if n == 0:
                    raise SystemExit("the sender closed early")
                if start is None:
                    start = cpu_now()
                got += n
            conn.sendall(b"k")
            print(json.dumps({"cpu": cpu_now() - start}), flush=True)


def sink(asynchronous: bool) -> grpc.GenericRpcHandler:
    """A handler that counts what arrives and answers once (a coroutine for grpc.aio)."""

    def take(requests, context):
        start, got = None, 0
        for message in requests:
            if start is None:
                start = cpu_now()
            got += len(message)
        print(json.dumps({"cpu": cpu_now() - start, "bytes": got}), flush=True)
        return b"k"

    async def take_async(requests, context):
        start, got = None, 0
        async for message in requests:
            if start is None:
                start = cpu_now()
            got += len(message)
        print(json.dumps({"cpu": cpu_now() - start, "bytes": got}), flush=True)
        return b"k"

    handler = take_async if asynchronous else take
    return grpc.method_handlers_generic_handler("floor.Sink", {
        "Take": grpc.stream_unary_rpc_method_handler(handler)})


def receive_grpc(kind: str, bind: str, chunk: int) -> None:
    if kind == "grpc-aio":
        async def serve() -> None:
            server = grpc.aio.server(options=channel_options(chunk))
            server.add_generic_rpc_handlers((sink(True),))
            port = server.add_insecure_port(f"{bind}:0")
            await server.start()
            print(port, flush=True)
            await server.wait_for_termination()
        asyncio.run(serve())
        return
    server = grpc.server(futures.ThreadPoolExecutor(2), options=channel_options(chunk))
    server.add_generic_rpc_handlers((sink(False),))
    port = server.add_insecure_port(f"{bind}:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


# -- senders: each returns (seconds, its CPU seconds) for one transfer ------------------------

def send_tcp(host: str, port: int, total: int, chunk: int) -> tuple[float, float]:
    message = memoryview(bytes(chunk))
    with socket.create_connection((host, port)) as conn:
        t0, c0 = time.perf_counter(), cpu_now()
        for _ in range(total // chunk):
            conn.sendall(message)
        if conn.recv(1) != b"k":
            raise SystemExit("no answer from the TCP receiver")
        return time.perf_counter() - t0, cpu_now() - c0


def send_grpc_sync(channel: grpc.Channel, total: int, chunk: int) -> tuple[float, float]:
    call = channel.stream_unary(METHOD)
    message = bytes(chunk)
    t0, c0 = time.perf_counter(), cpu_now()
    answer = call(iter([message] * (total // chunk)), timeout=300)
    assert answer == b"k", answer
    return time.perf_counter() - t0, cpu_now() - c0


async def send_grpc_aio(channel: grpc.aio.Channel, total: int, chunk: int) -> tuple[float, float]:
    message = bytes(chunk)

    async def messages():
        for _ in range(total // chunk):
            yield message

    t0, c0 = time.perf_counter(), cpu_now()
    answer = await channel.stream_unary(METHOD)(messages(), timeout=300)
    assert answer == b"k", answer
    return time.perf_counter() - t0, cpu_now() - c0


def send(kind: str, host: str, port: int, total: int, chunk: int, repeats: int) -> list:
    """The sender's side: ``repeats`` transfers, each (seconds, this process's CPU seconds)."""
    address = f"{host}:{port}"
    if kind == "grpc-aio":
        async def all_runs() -> list:
            async with grpc.aio.insecure_channel(address, channel_options(chunk)) as channel:
                return [await send_grpc_aio(channel, total, chunk) for _ in range(repeats)]
        return asyncio.run(all_runs())
    if kind == "grpc-sync":
        with grpc.insecure_channel(address, channel_options(chunk)) as channel:
            return [send_grpc_sync(channel, total, chunk) for _ in range(repeats)]
    return [send_tcp(host, port, total, chunk) for _ in range(repeats)]


def measure(kind: str, total: int, chunk: int, repeats: int, cluster=None,
            default_allocator: bool = False) -> list[dict]:
    """``repeats`` transfers of ``total`` bytes in ``chunk``-byte messages over ``kind``: on
    loopback, or from host ``sender`` to host ``receiver`` of an emulated ``cluster``."""
    common = ["--total", str(total), "--chunk", str(chunk), "--repeats", str(repeats),
              *(["--default-allocator"] if default_allocator else [])]
    me = [sys.executable, str(Path(__file__).resolve())]

    def start(host: str, argv: list[str]) -> subprocess.Popen:
        if cluster is None:
            return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        return cluster.popen(host, argv, stdout=subprocess.PIPE, text=True)

    host = "127.0.0.1" if cluster is None else cluster.address("receiver")
    bind = "127.0.0.1" if cluster is None else "0.0.0.0"
    receiver = start("receiver", [*me, "--receiver", kind, "--bind", bind, *common])
    sender = None
    try:
        port = int(receiver.stdout.readline())
        sender = start("sender", [*me, "--sender", kind, "--connect", f"{host}:{port}",
                                  *common])
        sent = json.loads(sender.stdout.readline())
        runs = []
        for seconds, cpu in sent:
            received = json.loads(receiver.stdout.readline())
            runs.append({"seconds": seconds, "sender_cpu": cpu, "receiver_cpu": received["cpu"]})
        return runs
    finally:
        for proc in (sender, receiver):
            if proc is not None:
                proc.kill()
                proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=512, help="MiB per transfer (default 512)")
    parser.add_argument("--chunk-kb", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rate", help="between two hosts of an emulated cluster (network "
                        "namespaces, tbf-shaped links of this rate, e.g. 10gbit; needs root) "
                        "instead of loopback")
    for role in ("--receiver", "--sender"):  # the processes this script starts
        parser.add_argument(role, choices=TRANSPORTS, help=argparse.SUPPRESS)
    for hidden in ("--bind", "--connect", "--total", "--chunk"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--default-allocator", action="store_true",
                        help="leave glibc's malloc thresholds as they are (by default both "
                        "processes raise them as gradstar's ranks and hub do: "
                        "gradstar.allocator)")
    args = parser.parse_args()
    if (args.receiver or args.sender) and not args.default_allocator:
        tune_allocator()
        if args.receiver:
            share_malloc_arena()  # as the hub and shards do
    if args.receiver == "tcp":
        receive_tcp(args.bind, int(args.total), int(args.chunk), args.repeats)
        return 0
    if args.receiver:
        receive_grpc(args.receiver, args.bind, int(args.chunk))
        return 0
    if args.sender:
        host, port = args.connect.rsplit(":", 1)
        print(json.dumps(send(args.sender, host, int(port), int(args.total), int(args.chunk),
                              args.repeats)), flush=True)
        return 0
    with contextlib.ExitStack() as stack:
        cluster = None
        if args.rate:
            from emulated_cluster import EmulatedCluster
            cluster = stack.enter_context(EmulatedCluster(["sender", "receiver"],
                                                          rate=args.rate))
        return report(args, cluster)


def report(args: argparse.Namespace, cluster) -> int:

    rows, results = [], {}
    for chunk_kb in args.chunk_kb:
        chunk = chunk_kb * 1024
        total = args.mb * MiB // chunk * chunk
        gb = total / 1e9
        tcp_cpu = None
        for kind in args.transports:
            runs = measure(kind, total, chunk, args.repeats, cluster, args.default_allocator)
            seconds = median([r["seconds"] for r in runs])
            sender = median([r["sender_cpu"] for r in runs]) / gb
            receiver = median([r["receiver_cpu"] for r in runs]) / gb
            both = sender + receiver
            if kind == "tcp":
                tcp_cpu = both
            results.setdefault(kind, {})[chunk_kb] = {
                "runs": runs, "gb_per_s": gb / seconds, "sender_cpu_s_per_gb": sender,
                "receiver_cpu_s_per_gb": receiver}
            rows.append([kind, f"{chunk_kb}", f"{gb / seconds:.2f}", f"{sender:.3f}",
                         f"{receiver:.3f}", f"{both:.3f}",
                         f"{both / tcp_cpu:.2f}x" if tcp_cpu else "-"])
            print(f"  {kind:10s} {chunk_kb:5d} KiB {gb / seconds:6.2f} GB/s {both:.3f} CPU-s/GB",
                  file=sys.stderr, flush=True)
    print()
    print(format_table(["transport", "message KiB", "GB/s", "CPU-s/GB sender",
                        "CPU-s/GB receiver", "CPU-s/GB both", "vs TCP"], rows))
    where = f"between emulated hosts at {args.rate}" if cluster else "over loopback"
    where += ", glibc's default malloc thresholds" if args.default_allocator else (
        ", malloc thresholds raised as in gradstar's processes")
    print(f"\none way {where}, {args.mb} MiB per transfer, median of {args.repeats}; "
          f"CPU: each process's user + system, all threads; load average at end "
          f"{loadavg()}")
    if args.json:
        write_json(args, "grpc_floor", results=results, environment=environment())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

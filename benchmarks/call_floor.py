"""What one tiny collective costs before gradstar adds anything: a 2-rank star on gRPC-python
that does nothing but pair the ranks' messages, beside gloo's and gradstar's all_reduce of the
same 100 bytes, in the same run.

Why
    A tiny all_reduce is messages and threads, not bytes (docs/performance.md, "Per call: small
    tensors"). Each rank sends one message to the hub and waits for one back; the hub answers
    both once both are in. This runs exactly that exchange with no frames, checksums, checks
    or bookkeeping: a grpc.aio hub whose handler pairs the two streams' messages (an asyncio
    future and queue, as a hub must) and answers each with the other's bytes, and ranks on
    either kind of blocking stream gradstar's direct lane can use
    (:mod:`gradstar.client.collective.caller_stream`): gRPC's public one (``queued``: its
    own threads write and deliver) or one the caller polls (``caller``). What gradstar's own
    all_reduce costs above that floor is gradstar's.

What it prints
    Per row: rank 0's median microseconds per call, its ratio to gloo's, and CPU microseconds
    per call of a rank (its process) and of the hub (its process; gloo has none).

How to reproduce
    .venv/bin/python benchmarks/call_floor.py                 # 2000 calls of 100 B per row
    .venv/bin/python benchmarks/call_floor.py --calls 5000 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _processes import cpu_seconds_of, free_port
from _report import environment, format_table, git_commit, loadavg, median, write_json
from allreduce import run_gloo, run_gradstar

METHOD = "/floor.Pair/Exchange"
PAYLOAD = 100
KINDS = ("queued", "caller")


def serve(port: int) -> None:
    """The hub: pair each message with the other stream's message of the same call number."""

    async def main() -> None:
        server = grpc.aio.server()
        waiting: dict[bytes, tuple[asyncio.Future, asyncio.Queue]] = {}

        async def exchange(requests, context):
            answers: asyncio.Queue = asyncio.Queue()
            async for message in requests:
                key = message[:8]
                other = waiting.pop(key, None)
                if other is None:
                    arrived = asyncio.get_running_loop().create_future()
                    waiting[key] = (arrived, answers)
                    await arrived
                    yield await answers.get()
                else:
                    done, their_answers = other
                    their_answers.put_nowait(message)
                    done.set_result(None)
                    yield message

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "floor.Pair", {"Exchange": grpc.stream_stream_rpc_method_handler(exchange)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def floor_rank(kind: str, port: int, calls: int, warmup: int, start, results) -> None:
    from gradstar.client.collective.caller_stream import CallerStream, QueuedStream

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    stream = (CallerStream if kind == "caller" else QueuedStream)(channel, METHOD, ())
    body = b"x" * PAYLOAD
    times = []
    for i in range(warmup + calls):
        if i == warmup:
            start.wait(timeout=60)  # both ranks time the same calls
            cpu0 = time.process_time()
        message = i.to_bytes(8, "little") + body
        t0 = time.perf_counter()
        stream.send(message)
        answer = stream.read()
        times.append(time.perf_counter() - t0)
        if answer is None or answer[:8] != message[:8] or len(answer) != len(message):
            raise RuntimeError(f"call {i}: a wrong answer from the hub")
    cpu = time.process_time() - cpu0
    stream.close()
    channel.close()
    results.put({"times": times[warmup:], "cpu_s": cpu})


def run_floor(kind: str, calls: int, warmup: int) -> dict:
    port = free_port()
    hub = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        ctx = mp.get_context("spawn")
        start, results = ctx.Barrier(2), ctx.Queue()
        ranks = [ctx.Process(target=floor_rank, args=(kind, port, calls, warmup, start, results))
                 for _ in range(2)]
        for p in ranks:
            p.start()
        time.sleep(0.5)
        hub0 = cpu_seconds_of(hub.pid)
        got = [results.get(timeout=300) for _ in ranks]
        hub_cpu = cpu_seconds_of(hub.pid) - hub0  # includes the ranks' warmup: a slight excess
        for p in ranks:
            p.join(30)
            if p.exitcode != 0:
                raise RuntimeError(f"a {kind} rank failed (exit {p.exitcode})")
    finally:
        hub.kill()
        hub.wait()
    return {"median_us": median(got[0]["times"]) * 1e6,
            "rank_cpu_us": median([g["cpu_s"] for g in got]) / calls * 1e6,
            "hub_cpu_us": hub_cpu / (calls + warmup) * 1e6}


def run_row(name: str, calls: int, warmup: int, timeout: float) -> dict:
    elements = PAYLOAD // 4
    if name == "gloo":
        s = run_gloo(2, elements, warmup, calls, timeout, "call floor")
        return {"median_us": s["median_ms"] * 1e3,
                "rank_cpu_us": s["ranks_cpu_s"] / 2 / calls * 1e6, "hub_cpu_us": None}
    if name == "gradstar":
        s = run_gradstar(2, elements, warmup, calls, timeout, "call floor", 0, None, "stream",
                         in_place=True)
        hub = s.get("hub_cpu_s")
        return {"median_us": s["median_ms"] * 1e3,
                "rank_cpu_us": s["ranks_cpu_s"] / 2 / calls * 1e6,
                "hub_cpu_us": None if hub is None else hub / calls * 1e6}
    return run_floor(name, calls, warmup)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per row")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1, help="alternated runs of every row")
    parser.add_argument("--rows", nargs="+", default=["gloo", *KINDS, "gradstar"],
                        choices=["gloo", *KINDS, "gradstar"])
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return 0
    env = environment()
    print(f"call floor: 2 ranks x {PAYLOAD} B, {args.calls} calls x {args.repeats} repeats; "
          f"gradstar {git_commit()}, {env['cpus']} CPUs, load average {env['loadavg_at_start']}")
    runs: dict[str, list[dict]] = {name: [] for name in args.rows}
    for repeat in range(args.repeats):
        for name in args.rows:
            runs[name].append(run_row(name, args.calls, args.warmup, args.timeout))
            print(f"  #{repeat} {name:9s} {runs[name][-1]['median_us']:7.0f} us", flush=True)
    gloo = median([r["median_us"] for r in runs["gloo"]]) if "gloo" in runs else None

    def cell(name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name] if r[key] is not None]
        return median(values) if values else None

    rows = []
    for name in args.rows:
        us = cell(name, "median_us")
        hub = cell(name, "hub_cpu_us")
        rows.append([name, f"{us:.0f}", "-" if gloo is None else f"{us / gloo:.2f}",
                     f"{cell(name, 'rank_cpu_us'):.0f}", "-" if hub is None else f"{hub:.0f}"])
    print()
    print(format_table(["row", "us per call", "vs gloo", "rank CPU us/call",
                        "hub CPU us/call"], rows))
    print("\nqueued / caller: the bare 2-rank star on gRPC (no gradstar code on the hub, only "
          "the ranks' stream class); gloo and gradstar: a 100 B all_reduce (benchmarks/"
          f"allreduce.py's ranks, a barrier before each call). Medians over {args.repeats} "
          f"alternated runs; load average at end {loadavg()}.")
    if args.json:
        write_json(args, "call_floor", environment=env, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

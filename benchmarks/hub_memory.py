"""What the hub gives back: memory, mappings and descriptors after ranks come and go, and the
job table and /metrics under a flood of joins that never form (issue 28's targets).

What is measured
    ``soak``: a ``gradstar coordinator`` subprocess (``--shards 0``) and ``--rounds`` rounds of
    two spawned rank processes, each doing ``--iters`` all_reduces of ``--mb`` MiB; the rounds
    alternate the data path (shared memory, then the gRPC stream) and, every other pair of
    rounds, rank 1 is SIGKILLed mid-loop instead of exiting cleanly. Before the first round and
    ``--settle`` seconds (15) after the last one, the hub's private memory (VmRSS less RssShmem,
    the ranks' segments it maps), the segments it maps (/proc/PID/maps) and its open
    descriptors are read.

    ``flood``: a coordinator in this process (``--max-jobs`` 1000, a metrics port) gets
    ``--joins`` joins of distinct jobs that never form (each alone, with a 50 ms join timeout;
    200 at a time). Then a new two-rank job joins (its time to form is shown), /metrics is
    fetched (its size), and while it is rendered a task measures how late the event loop runs a
    1 ms timer (the lag every collective would see).

    ``headers``: a coordinator subprocess (default budget) and one member of a two-rank job
    (rank 1 never comes) that sends ``--headers`` headers at the chunk limit (2^20 chunks of 2
    bytes: 128 KiB of chunk tracker each, charged to the budget, allocated only once a chunk
    comes) and holds them pending; the hub's private memory is read at the peak, how many
    headers were refused (by the job's share of the budget, a quarter), and again 5 s after the
    streams closed. Measured 2026-11-27 (2-core VM, loaded), 1,536 headers: 1,032 refused, peak
    +25 MiB, +25 MiB 5 s after (before the bit-per-chunk tracker and the job share: 1,271
    refused by the whole budget, peak +89 MiB, +26 MiB after; what stays is not the trackers).

How to reproduce
    .venv/bin/python benchmarks/hub_memory.py                        # both parts
    .venv/bin/python benchmarks/hub_memory.py soak --rounds 40 --iters 25 --mb 16
    .venv/bin/python benchmarks/hub_memory.py flood --joins 10000
    .venv/bin/python benchmarks/hub_memory.py headers --headers 1536
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import CoordinatorProcess

MIB = 1 << 20


def hub_state(pid: int) -> dict:
    """Private memory (MiB), mapped segments and open descriptors of process ``pid``."""
    from gradstar.transport.shm import NAME

    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "RssShmem:")):
            fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {"private_mib": (fields["VmRSS"] - fields.get("RssShmem", 0)) / MIB,
            "segments": len({tuple(m.split()[3:5]) for m in maps if f"/memfd:{NAME}" in m}),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def rank_main() -> int:
    """A rank: ``--iters`` all_reduces, checked exactly, one progress line each."""
    import numpy as np

    import gradstar

    iters, mb = int(os.environ["BENCH_ITERS"]), int(os.environ["BENCH_MB"])
    with gradstar.init_process_group(timeout=60, join_timeout=60) as pg:
        x = np.full(mb * MIB // 4, float(pg.rank + 1), np.float32)
        for _ in range(iters):
            out = pg.all_reduce(x)
            assert out[0] == out[-1] == 3.0
            print("progress", pg.shared_memory, flush=True)
    return 0


def soak(args) -> dict:
    coord = CoordinatorProcess(shards=0, extra_args=["--heartbeat-timeout", "3"])
    address = coord.start()
    try:
        time.sleep(1)
        before = hub_state(coord.proc.pid)
        collectives = 0
        for r in range(args.rounds):
            shm = r % 2 == 0
            killed = (r // 2) % 2 == 1
            env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
            env.update(GRADSTAR_COORDINATOR=address, GRADSTAR_JOB=f"soak-{r}",
                       GRADSTAR_WORLD_SIZE="2", GRADSTAR_SHARED_MEMORY="1" if shm else "0",
                       BENCH_ITERS=str(args.iters), BENCH_MB=str(args.mb))
            ranks = [subprocess.Popen([sys.executable, __file__, "_rank"], text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      env={**env, "GRADSTAR_RANK": str(k)}) for k in range(2)]
            seen = 0
            for _ in ranks[1].stdout:
                seen += 1
                if killed and seen == args.iters // 2:
                    ranks[1].send_signal(signal.SIGKILL)
                    break
            collectives += seen
            for rank in ranks:
                rank.wait(timeout=120)
            print(f"round {r + 1}/{args.rounds}: {'shm' if shm else 'stream'}, "
                  f"{'rank 1 killed' if killed else 'clean exit'}, {seen} collectives; hub "
                  f"{hub_state(coord.proc.pid)}", flush=True)
        time.sleep(args.settle)
        after = hub_state(coord.proc.pid)
    finally:
        coord.stop()
    return {"collectives": collectives, "before": before, f"after_{args.settle:g}s": after,
            "private_growth_mib": after["private_mib"] - before["private_mib"],
            "fd_change": after["fds"] - before["fds"]}


async def flood(args) -> dict:
    import grpc
    import numpy as np

    import gradstar
    from gradstar.config import CoordinatorSettings
    from gradstar.coordinator import Coordinator
    from gradstar.proto.v1 import rendezvous_pb2 as rpb
    from gradstar.proto.v1 import rendezvous_pb2_grpc

    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0,
                                          max_jobs=args.max_jobs, log_level="ERROR"))
    await hub.start()
    try:
        started = time.monotonic()
        async with grpc.aio.insecure_channel(hub.address) as channel:
            stub = rendezvous_pb2_grpc.RendezvousStub(channel)

            async def join(i: int) -> None:
                call = stub.Session(iter([rpb.SessionRequest(join=rpb.JoinRequest(
                    job=f"abandoned-{i}", world_size=2, rank=0, timeout_seconds=0.05))]),
                    timeout=30)
                try:
                    await call.read()
                except grpc.aio.AioRpcError:
                    pass
            for start in range(0, args.joins, 200):
                await asyncio.gather(*(join(i) for i in range(start, min(start + 200,
                                                                         args.joins))))
        flood_s = time.monotonic() - started
        formed_at = time.monotonic()
        groups = await asyncio.gather(*(gradstar.init_process_group_async(
            coordinator=hub.address, job="after", world_size=2, rank=r, join_timeout=10)
            for r in range(2)))
        form_s = time.monotonic() - formed_at
        await asyncio.gather(*(g.all_reduce(np.ones(4, np.float32)) for g in groups))
        lags = []

        async def meter(stop: asyncio.Event) -> None:
            while not stop.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.001)
                lags.append(time.monotonic() - t - 0.001)

        stop = asyncio.Event()
        metering = asyncio.ensure_future(meter(stop))
        reader, writer = await asyncio.open_connection("127.0.0.1", hub.metrics_port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        body = (await asyncio.wait_for(reader.read(), 30)).partition(b"\r\n\r\n")[2]
        writer.close()
        stop.set()
        await metering
        await asyncio.gather(*(g.close() for g in groups))
        return {"joins": args.joins, "flood_seconds": round(flood_s, 1),
                "jobs_in_table_after": len(hub.rendezvous.jobs) - 1,
                "new_job_formed_in_s": round(form_s, 3), "metrics_bytes": len(body),
                "max_loop_lag_ms_during_scrape": round(max(lags) * 1e3, 2)}
    finally:
        await hub.stop(grace=0)


async def headers(args) -> dict:
    import gradstar
    from gradstar.proto.v1 import collective_pb2 as pb
    from gradstar.wire import KIND_HEADER, encode_message

    coord = CoordinatorProcess(shards=0)
    address = coord.start()
    try:
        groups = await asyncio.gather(*(gradstar.init_process_group_async(
            coordinator=address, job="greedy", world_size=2, rank=r, join_timeout=10)
            for r in range(2)))
        g = groups[0]
        before = hub_state(coord.proc.pid)
        hold = asyncio.Event()
        calls = []
        for seq in range(args.headers):
            frame = encode_message(KIND_HEADER, pb.CollectiveHeader(
                job=g.job, generation=g.generation, group="hostile", seq=seq, rank=0,
                member_id=g.member_id, op=pb.COLLECTIVE_OP_ALL_REDUCE,
                reduce_op=pb.REDUCE_OP_SUM, timeout_seconds=600, dtype=pb.DTYPE_FLOAT16,
                shape=[1 << 20], chunk_bytes=2))

            async def frames(frame=frame):
                yield frame
                await hold.wait()
            calls.append(g._plane.coordinator.stream(frames(), metadata=g._metadata,
                                                     timeout=600))
        refused = 0
        for call in calls:
            try:
                await asyncio.wait_for(call.read(), 0.05)
                refused += 1  # the only frame the hub sends a pending header is its refusal
            except TimeoutError:
                pass
        peak = hub_state(coord.proc.pid)
        hold.set()
        for call in calls:
            call.cancel()
        await asyncio.sleep(5)
        after = hub_state(coord.proc.pid)
        await asyncio.gather(*(x.close() for x in groups))
    finally:
        coord.stop()
    return {"headers": args.headers, "refused": refused, "before_mib": before["private_mib"],
            "peak_mib": peak["private_mib"], "after_close_5s_mib": after["private_mib"]}


def main() -> int:
    if sys.argv[1:2] == ["_rank"]:
        return rank_main()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", nargs="?", choices=("soak", "flood", "headers", "both"),
                        default="both", help="'both': soak and flood")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--mb", type=int, default=16)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--joins", type=int, default=10_000)
    parser.add_argument("--max-jobs", type=int, default=1000)
    parser.add_argument("--headers", type=int, default=1536)
    args = parser.parse_args()
    results = {}
    if args.part == "headers":
        results["headers"] = asyncio.run(headers(args))
        print(json.dumps(results["headers"]), flush=True)
    if args.part in ("flood", "both"):
        results["flood"] = asyncio.run(flood(args))
        print(json.dumps(results["flood"]), flush=True)
    if args.part in ("soak", "both"):
        results["soak"] = soak(args)
        print(json.dumps(results["soak"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The hub's Python per tiny collective, without sockets (issue 36).

What is measured
    The coordinator's collective servicer (``CollectiveServicer.Stream``: frames, checks,
    matching, the reduction, the straggler bookkeeping, the budget, the answers) driven by two
    ranks' messages on one event loop, no gRPC and no sockets: each rank's stream yields,
    collective after collective, exactly the one message gradstar's direct lane sends for a
    ``--numel``-element float32 all_reduce (:func:`gradstar.client.collective.outgoing.
    in_one_message`), the next one only after that rank's answer came out. Prints microseconds
    per collective (the mean over ``--collectives``, after 1 untimed) for ``--repeats`` runs.
    The small fake ranks (a queue each) are included; they cost a few microseconds.

    What a tiny collective costs the running hub beyond this is gRPC's (its Cython, the two
    ``sendmsg``, the hand-offs to the event loop): ``benchmarks/call_floor.py`` measures that
    floor, ``benchmarks/allreduce.py`` the whole.

    ``--engine-only`` leaves the servicer out: each rank's message is split, its header decoded
    and admitted and its frames taken on this thread, then every answer frame taken from the
    outboxes -- the engine's synchronous part alone, so that the difference is the servicer's
    async generators, outbox waits and task switches.

How to reproduce
    .venv/bin/python benchmarks/hub_python.py                       # 5000 collectives x 3
    .venv/bin/python benchmarks/hub_python.py --engine-only         # the engine alone
    .venv/bin/python benchmarks/hub_python.py --profile /tmp/hub.prof   # cProfile of one run

Not asserted: any timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time

import numpy as np

from gradstar import ops
from gradstar.client.collective.outgoing import in_one_message
from gradstar.client.collective.plan import CollectivePlan
from gradstar.config import CoordinatorSettings
from gradstar.coordinator.collective import CollectiveEngine
from gradstar.coordinator.collective.engine import CLOSE
from gradstar.coordinator.collective.servicer import CollectiveServicer
from gradstar.coordinator.rendezvous import Rendezvous
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.wire import KIND_HEADER, decode_message, frames_of

WORLD = 2


class _Context:
    """What the servicer asks of a gRPC context on a collective that succeeds: nothing."""

    async def abort(self, code, details):
        raise RuntimeError(f"the hub aborted a stream: {code} {details}")


def _engine() -> CollectiveEngine:
    """An engine with the coordinator's default limits and budget, as ``gradstar coordinator``
    builds it."""
    return CollectiveEngine.from_settings(Rendezvous(60), CoordinatorSettings())


async def run(collectives: int, numel: int, profile: str | None,
              engine_only: bool = False) -> float:
    """Seconds per collective of ``collectives`` all_reduces after one untimed."""
    engine = _engine()
    members = await asyncio.gather(*(engine.rendezvous.join("bench", WORLD, r, f"10.0.0.{r}:1",
                                                           timeout=10) for r in range(WORLD)))
    servicer = CollectiveServicer(engine, shared_memory=False)
    inputs = [np.full(numel, r + 1.0, dtype=np.float32) for r in range(WORLD)]

    def message(member, seq: int) -> bytes:
        h = pb.CollectiveHeader(job="bench", generation=member.generation.number,
                                group="default", seq=seq, rank=member.rank,
                                member_id=member.member_id, op=pb.COLLECTIVE_OP_ALL_REDUCE,
                                reduce_op=pb.REDUCE_OP_SUM, dtype=pb.DTYPE_FLOAT32,
                                shape=[numel], chunk_bytes=1 << 18, timeout_seconds=60.0)
        call = ops.CollectiveCall.of(h, WORLD)
        plan = CollectivePlan.for_call(call, inputs[member.rank], np.empty_like(inputs[0]))
        return in_one_message(h, plan, call.geometry.sends, None)

    total = collectives + 1
    messages = [[message(m, seq) for seq in range(1, total + 1)] for m in members]
    if engine_only:
        return _engine_only(engine, messages, collectives, profile)
    answers = [asyncio.Queue() for _ in range(WORLD)]
    turns = [asyncio.Queue() for _ in range(WORLD)]

    async def requests(r: int):
        for k in range(total):
            if k:
                await turns[r].get()
            yield messages[r][k]

    async def serve(r: int) -> None:
        async for answer in servicer.Stream(requests(r), _Context()):
            answers[r].put_nowait(answer)

    async def rank(r: int, first: asyncio.Future) -> None:
        for k in range(total):
            await answers[r].get()
            if k == 0:
                first.set_result(None)
            turns[r].put_nowait(None)

    loop = asyncio.get_running_loop()
    servers = [asyncio.create_task(serve(r)) for r in range(WORLD)]
    firsts = [loop.create_future() for _ in range(WORLD)]
    ranks = [asyncio.create_task(rank(r, firsts[r])) for r in range(WORLD)]
    await asyncio.gather(*firsts)
    with _timed(profile) as took:
        await asyncio.wait_for(asyncio.gather(*ranks), 600)
    await asyncio.wait_for(asyncio.gather(*servers), 10)  # each stream ended: the hub's END
    return took[0] / collectives


@contextlib.contextmanager
def _timed(profile: str | None):
    """Time the block (seconds in the yielded list's one item), under cProfile into
    ``profile`` if one is named."""
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    took = [0.0]
    began = time.perf_counter()
    try:
        yield took
    finally:
        took[0] = time.perf_counter() - began
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)


def _engine_only(engine: CollectiveEngine, messages: list[list[bytes]], collectives: int,
                 profile: str | None) -> float:
    """The same collectives without the servicer's generators and waits: each rank's message
    split into frames, its header decoded and admitted, its frames taken (what the servicer's
    ``_collective`` does before its first wait), every answer frame taken from the outboxes,
    one rank after the other on this thread."""

    def one(k: int) -> None:
        arrived = []
        for r in range(WORLD):
            frames = frames_of(messages[r][k])
            header = decode_message(frames[0], KIND_HEADER, pb.CollectiveHeader)
            coll, me = engine.arrive(header, None)
            if CollectiveServicer._take_arrived(coll, me, frames[1:]) is not None:
                raise RuntimeError("a one-message collective left frames for a reader")
            arrived.append(me)
        for me in arrived:
            while me.outbox.get_nowait() is not CLOSE:
                pass

    one(0)
    with _timed(profile) as took:
        for k in range(1, collectives + 1):
            one(k)
    return took[0] / collectives


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collectives", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--numel", type=int, default=25, help="float32 elements (default 25)")
    parser.add_argument("--profile", help="write one run's cProfile stats here")
    parser.add_argument("--engine-only", action="store_true",
                        help="without the servicer: the engine's synchronous part alone (frames, "
                             "header, matching, reduction, bookkeeping, answers queued)")
    args = parser.parse_args()
    times = []
    for i in range(args.repeats):
        t = asyncio.run(run(args.collectives, args.numel, args.profile if i == 0 else None,
                            args.engine_only))
        times.append(t)
        print(f"run {i + 1}: {t * 1e6:.1f} us per collective", flush=True)
    print(f"median {statistics.median(times) * 1e6:.1f} us per collective of {args.numel} "
          f"float32, {WORLD} ranks, {args.collectives} collectives per run"
          + (", the engine alone" if args.engine_only else "")
          + (" (run 1 under cProfile)" if args.profile else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

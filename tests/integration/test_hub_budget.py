"""The hub's budget for pending collectives, each job's share of it, and the caps on pending
collectives per member and per job.

A member of a job can send headers that each cost the hub 132 KiB (a chunk tracker for 2^20
chunks, a bit each, and the rank's part) and keep them pending: each header passes every
per-header check. Beyond the hub's
budget, or the caps, a header is refused with HubCapacityError (RESOURCE_EXHAUSTED) naming the
limit, to that caller only: another job's collectives still complete, exactly; and what the
pending headers held is given back when their streams close.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gradstar import errors
from gradstar.proto.v1 import collective_pb2 as pb
from gradstar.transport.status import status_code
from gradstar.wire import KIND_HEADER, decode_error, encode_message

from .conftest import close_all, join_all, until

MIB = 1 << 20
#: A header at the chunk limit: 2^20 chunks of 2 bytes (float16), 128 KiB of tracker and 4 KiB
#: for the rank's part (coordinator/collective/budget.py).
AT_THE_CHUNK_LIMIT = dict(dtype=pb.DTYPE_FLOAT16, shape=[1 << 20], chunk_bytes=2)
#: An ordinary small header.
SMALL = dict(dtype=pb.DTYPE_FLOAT32, shape=[4], chunk_bytes=1 << 20)


def header(g, seq: int, **fields) -> bytes:
    h = pb.CollectiveHeader(
        job=g.job, generation=g.generation, group="hostile", seq=seq, rank=g.rank,
        member_id=g.member_id, op=pb.COLLECTIVE_OP_ALL_REDUCE, reduce_op=pb.REDUCE_OP_SUM,
        timeout_seconds=60, **fields)
    return encode_message(KIND_HEADER, h)


class PendingHeaders:
    """Raw Collective streams of one rank, each a header and then silence: collectives the
    hub holds pending until the streams close."""

    def __init__(self, g) -> None:
        self.g = g
        self.calls = []
        self._hold = asyncio.Event()

    def open(self, frame: bytes):
        async def frames():
            yield frame
            await self._hold.wait()

        call = self.g._plane.coordinator.stream(frames(), metadata=self.g._metadata, timeout=60)
        self.calls.append(call)
        return call

    async def close(self) -> None:
        self._hold.set()
        for call in self.calls:
            call.cancel()


async def bystander_all_reduce(groups) -> None:
    x = np.arange(1 << 18, dtype=np.float32)
    results = await asyncio.wait_for(asyncio.gather(*(g.all_reduce(x) for g in groups)), 20)
    for result in results:
        np.testing.assert_array_equal(result, 2 * x)


CASES = {
    # 7 headers of 132 KiB fit in 1 MiB; the 8th does not (no per-job share: the hub's limit).
    "budget": (dict(max_collective_state_bytes=MIB, collective_state_job_share=1.0),
               AT_THE_CHUNK_LIMIT, 7,
               "of which", "(coordinator setting max_collective_state_bytes)"),
    # Half of 1 MiB is the job's share: 3 headers of 132 KiB fit, the 4th does not.
    "job share": (dict(max_collective_state_bytes=MIB, collective_state_job_share=0.5),
                  AT_THE_CHUNK_LIMIT, 3, "job 'greedy' already holds",
                  "of its share of 524288 bytes (0.5 of max_collective_state_bytes; "
                  "coordinator setting collective_state_job_share)"),
    "per member": (dict(max_pending_per_member=5), SMALL, 5,
                   "the rank has 5 collectives pending, its limit",
                   "(coordinator setting max_pending_per_member)"),
    "per job": (dict(max_pending_per_job=5), SMALL, 5,
                "job 'greedy' has 5 collectives pending, its limit",
                "(coordinator setting max_pending_per_job)"),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", CASES)
async def test_pending_collectives_beyond_a_limit_are_refused_to_their_caller_only(
        start_coordinator, case):
    settings, fields, fit, message, setting = CASES[case]
    hub = await start_coordinator(**settings)
    budget = hub.engine.budget
    # Rank 1 of the greedy job never comes: rank 0's collectives stay pending.
    greedy = await join_all(hub.address, 2, job="greedy")
    bystanders = await join_all(hub.address, 2, job="bystander")
    pending = PendingHeaders(greedy[0])
    try:
        for seq in range(fit):
            pending.open(header(greedy[0], seq, **fields))
            await until(lambda n=seq + 1: len(greedy_collectives(hub)) == n,
                        f"header {seq + 1} pending")
        held = budget.used
        refused = pending.open(header(greedy[0], fit, **fields))
        verdict = decode_error(await asyncio.wait_for(refused.read(), 20))
        assert isinstance(verdict, errors.HubCapacityError), verdict
        assert message in str(verdict) and setting in str(verdict), str(verdict)
        assert status_code(verdict).name == "RESOURCE_EXHAUSTED"
        assert budget.used == held
        # Another job is not refused, and its results are exact.
        await bystander_all_reduce(bystanders)
    finally:
        await pending.close()
    # Everything the pending headers held is given back once their streams close.
    await until(lambda: budget.used == 0 and not greedy_collectives(hub),
                "the pending collectives' budget given back")
    try:
        await bystander_all_reduce(bystanders)
        await bystander_all_reduce(greedy)
    finally:
        await close_all([*greedy, *bystanders])


def greedy_collectives(hub) -> dict:
    gen = hub.rendezvous.jobs["greedy"].generation
    return {key: c for key, c in gen.collectives.items() if key[0] == "hostile"}



async def flood(pending: PendingHeaders, hub, fields: dict, first: int, most: int = 2000):
    """Open headers of ``fields`` from seq ``first`` on until the hub refuses one: (the next
    seq, the refusal)."""
    reads = []
    for seq in range(first, first + most):
        read = asyncio.ensure_future(pending.open(header(pending.g, seq, **fields)).read())
        reads.append(read)  # answered (an error frame) only if refused
        await until(lambda seq=seq, read=read: read.done() or
                    ("hostile", seq) in greedy_collectives(hub), f"header {seq} answered")
        if read.done():
            return seq + 1, decode_error(read.result())
    raise AssertionError(f"{most} headers were all admitted")


@pytest.mark.timeout(120)
async def test_a_job_that_floods_headers_leaves_the_other_jobs_their_budget(start_coordinator):
    # A quarter of 2 MiB (the default share) is the greedy job's: it floods headers at the chunk
    # limit (132 KiB each) until refused, then small ones (~4 KiB) to take the last bytes of its
    # share. Without a share it would take the whole budget, and the bystander's headers would
    # be refused (collective_state_job_share=1 here: HubCapacityError at its first all_reduce).
    hub = await start_coordinator(max_collective_state_bytes=2 * MIB)
    budget = hub.engine.budget
    assert budget.max_job_bytes == MIB // 2
    greedy = await join_all(hub.address, 2, job="greedy")
    bystanders = await join_all(hub.address, 2, job="bystander")
    pending = PendingHeaders(greedy[0])
    try:
        seq, refused = await flood(pending, hub, AT_THE_CHUNK_LIMIT, 0)
        assert seq == 4  # 3 headers of 132 KiB fit in 512 KiB
        seq, refused = await flood(pending, hub, SMALL, seq)
        assert isinstance(refused, errors.HubCapacityError), refused
        assert "job 'greedy' already holds" in str(refused), str(refused)
        assert "coordinator setting collective_state_job_share" in str(refused)
        held = budget.job_used["greedy"]
        assert MIB // 2 - (4 << 10) - 1 < held <= MIB // 2 == budget.max_job_bytes
        # The bystander's collectives open and complete, exactly (each rank's part costs
        # ~4 KiB, more than the greedy job would have left of the whole budget).
        for _ in range(3):
            await bystander_all_reduce(bystanders)
        assert budget.job_used["greedy"] == held
    finally:
        await pending.close()
        await close_all(greedy)  # the greedy job's members go
    await until(lambda: budget.used == 0 and "greedy" not in budget.job_used,
                "the greedy job's budget given back")
    try:
        await bystander_all_reduce(bystanders)
    finally:
        await close_all(bystanders)

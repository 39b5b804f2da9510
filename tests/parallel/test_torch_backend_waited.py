"""Collectives whose torch caller waits at once (``dist.all_reduce(t)``: ``opts.asyncOp`` False)
run to their end on the caller's thread and come back settled, with no completion thread
(gradstar.client.torch_backend.group's ``_launch``), against a real coordinator: two ranks, each
a real blocking gradstar ProcessGroup under the backend's ProcessGroupGradstar, on threads of
this process. Exact results, the hub's errors labelled and raised by ``wait()`` as before, a
finished rank named; an ``async_op=True`` call still completes on a completion thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import gradstar
from gradstar.client.torch_backend.group import ProcessGroupGradstar
from gradstar.client.torch_backend.work import CompletionThreads
from gradstar.errors import CollectiveMismatchError, RankFinishedError

pytestmark = pytest.mark.timeout(120)
TINY, LARGE = 25, 1 << 18  # float32 elements: 100 bytes (the direct lane), 1 MiB (the loop)


def _opts(cls, waited: bool):
    opts = cls()
    opts.asyncOp = not waited
    return opts


def _completion_threads(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def rank_body(address: str, rank: int, job: str, finished: threading.Event,
              device: str = "cpu") -> dict:
    """One rank's calls on tensors on ``device`` (tests/cuda runs it on ``"cuda"``)."""
    prefix = f"waited-test-{job}-{rank}"
    completions = CompletionThreads(name=prefix)
    group = gradstar.init_process_group(coordinator=address, job=job, world_size=2, rank=rank,
                                        timeout=20, join_timeout=20)
    pg = ProcessGroupGradstar(group, completions)
    report: dict = {}
    try:
        for name, n in (("tiny", TINY), ("large", LARGE)):
            t = torch.full((n,), float(rank + 1), device=device)
            work = pg.allreduce([t], _opts(dist.AllreduceOptions, waited=True))
            report[name] = {"settled_at_return": work.is_completed(),
                            "exact": bool((t == 3.0).all()), "wait": work.wait(),
                            "device": t.device.type}
            # A settled Work's future is made when asked for: done, of the output tensors.
            future = work.get_future()
            value = future.wait()
            report[name]["future"] = (future.done(), future is work.get_future(),
                                      value[0] is t, value[0][:1].tolist())
        # The result is written into t's memory by the SDK itself (no copy_ of torch's): the
        # write still counts as an in-place op, once, so autograd refuses a graph that saved t.
        x = torch.ones(TINY, device=device, requires_grad=True)
        t = torch.full((TINY,), float(rank + 1), device=device)
        y = (x * t).sum()
        before = t._version
        pg.allreduce([t], _opts(dist.AllreduceOptions, waited=True)).wait()
        try:
            y.backward()
            backward = "ran"
        except RuntimeError as error:
            backward = "refused" if "modified by an inplace operation" in str(error) else str(
                error)
        report["in_place"] = (t._version - before, backward, t[:1].tolist())
        work = pg.barrier(_opts(dist.BarrierOptions, waited=True))
        report["barrier"] = work.is_completed() and work.wait()
        gathered = torch.zeros(2 * TINY, device=device)
        work = pg._allgather_base(gathered,
                                  torch.full((TINY,), float(rank), device=device),
                                  _opts(c10d.AllgatherOptions, waited=True))
        report["all_gather"] = (work.is_completed(), gathered[TINY - 1:TINY + 1].tolist())
        shard = torch.zeros(TINY, device=device)
        work = pg._reduce_scatter_base(shard, torch.arange(2.0 * TINY, device=device),
                                       _opts(c10d.ReduceScatterOptions, waited=True))
        report["reduce_scatter"] = (work.is_completed(), shard[:1].tolist())
        report["threads_after_waited"] = _completion_threads(prefix)
        # Ranks disagree on the shape: the Work fails with the hub's error, labelled.
        mismatched = torch.ones(4 + rank, device=device)
        bad = pg.allreduce([mismatched], _opts(dist.AllreduceOptions, waited=True))
        try:
            bad.wait()
        except CollectiveMismatchError as error:
            # Nothing written: the tensor's version stays (as for torch's failed in-place ops)
            report["mismatch"] = (bad.is_completed(), str(error), mismatched._version)
        try:
            bad.get_future().wait()
        except RuntimeError as error:  # torch raises the callback's error from C++
            report["mismatch_future"] = str(error)
        t = torch.full((TINY,), float(rank + 1), device=device)
        pg.allreduce([t], _opts(dist.AllreduceOptions, waited=True)).wait()
        report["after"] = t[:2].tolist()
        t = torch.full((TINY,), float(rank + 1), device=device)
        pg.allreduce([t], _opts(dist.AllreduceOptions, waited=False)).get_future().wait()
        report["async"] = (t[:2].tolist(), len(_completion_threads(prefix)) > 0)
        if rank == 1:
            pg.shutdown()
            finished.set()
            # Issued on a closed group: the Work comes back failed, at once, version kept.
            t = torch.ones(TINY, device=device)
            closed = pg.allreduce([t], _opts(dist.AllreduceOptions, waited=True))
            report["closed"] = (closed.is_completed(), type(closed.exception()).__name__,
                                t._version)
            # ... and through the general path (bfloat16: no numpy view), alike.
            closed = pg.allreduce([t.bfloat16()], _opts(dist.AllreduceOptions, waited=True))
            report["closed_general"] = (closed.is_completed(),
                                        type(closed.exception()).__name__)
        else:
            assert finished.wait(30)
            lost = pg.allreduce([torch.ones(TINY, device=device)],
                                _opts(dist.AllreduceOptions, waited=True))
            try:
                lost.wait()
            except RankFinishedError as error:
                report["finished"] = str(error)
    finally:
        pg.shutdown()
        completions.close()
    return report


async def run_ranks(address: str, device: str = "cpu") -> list[dict]:
    """Both ranks' reports of :func:`rank_body` (on threads of this process)."""
    finished = threading.Event()
    return await asyncio.wait_for(asyncio.gather(*(
        asyncio.to_thread(rank_body, address, rank, "waited", finished, device)
        for rank in (0, 1))), 90)


def check_reports(reports: list[dict], device: str = "cpu") -> None:
    for rank, report in enumerate(reports):
        for name in ("tiny", "large"):
            assert report[name] == {"settled_at_return": True, "exact": True, "wait": True,
                                    "device": device, "future": (True, True, True, [3.0])}
        assert report["in_place"] == (1, "refused", [3.0])
        assert report["barrier"] is True
        assert report["all_gather"] == (True, [0.0, 1.0])
        assert report["reduce_scatter"] == (True, [2.0 * TINY * rank])  # 2 x arange, shard r
        assert report["threads_after_waited"] == [], report  # no completion thread started
        settled, message, version = report["mismatch"]
        assert settled and message.startswith(f"[Rank {rank}] ranks disagree"), message
        assert version == 0
        assert "(shape differs)" in message
        assert "ranks disagree" in report["mismatch_future"], report["mismatch_future"]
        assert report["after"] == [3.0, 3.0]
        assert report["async"] == ([3.0, 3.0], True)
    assert reports[1]["closed"] == (True, "ProcessGroupClosedError", 0), reports[1]["closed"]
    assert reports[1]["closed_general"] == (True, "ProcessGroupClosedError")
    message = reports[0]["finished"]
    assert message.startswith("[Rank 0] rank 1 of job 'waited' finished"), message


async def test_a_waited_collective_is_settled_on_the_callers_thread(start_coordinator):
    coordinator = await start_coordinator()
    check_reports(await run_ranks(coordinator.address))

"""A rank for tests/integration/test_roads.py: one small all_reduce after another over one road a
collective can take, until one fails by the fault the test injects; it prints the error as JSON.

``python roads_script.py ROAD FAULT`` with the ``GRADSTAR_*`` env of a rank. Roads:

- ``stream``: the blocking API's ``all_reduce(x, async_op=True).wait()``, which runs on the
  group's loop (:func:`gradstar.client.collective.stream.run_stream`);
- ``direct``: the blocking ``all_reduce(x)`` of a small array, which the caller's thread runs
  over the direct lane (:class:`gradstar.client.collective.direct.DirectLane`);
- ``torch``: ``dist.all_reduce(t)`` of a small CPU tensor over backend "gradstar", a waited call
  settled on the caller's thread (``ProcessGroupGradstar._settled``).

Faults, from round :data:`FAULT_ROUND` on: ``mismatch`` (the last rank's array is one element
longer), ``timeout`` (rank 1 stops calling and waits for a line on stdin; the group's collective
timeout is :data:`SHORT_TIMEOUT`), ``rank`` and ``hub`` (the test kills rank 1 or the coordinator
once rank 1 printed a progress line).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from datetime import timedelta

import numpy as np

import gradstar
from gradstar.errors import GradstarError

FAULT_ROUND = 3
#: The collective timeout (seconds) of the ``timeout`` fault's group; every other fault's is 60.
SHORT_TIMEOUT = 2.0
ELEMENTS = 25  # float32: 100 bytes, small enough for the direct lane


def gradstar_road(road: str, fault: str):
    """The group and one round's all_reduce on road ``stream`` or ``direct``; and how many
    collectives the direct lane ran so far."""
    pg = gradstar.init_process_group(timeout=SHORT_TIMEOUT if fault == "timeout" else 60,
                                     join_timeout=60)
    if road == "stream":
        return pg, lambda x: pg.all_reduce(x, async_op=True).wait(30), pg._group.direct
    return pg, pg.all_reduce, pg._group.direct


def torch_road(fault: str):
    """The torch process group (over backend "gradstar") and one round's waited all_reduce."""
    import torch
    import torch.distributed as dist

    env = os.environ
    seconds = SHORT_TIMEOUT if fault == "timeout" else 60
    dist.init_process_group(
        backend="gradstar", rank=int(env["GRADSTAR_RANK"]),
        world_size=int(env["GRADSTAR_WORLD_SIZE"]), timeout=timedelta(seconds=seconds),
        init_method=f"gradstar://{env['GRADSTAR_COORDINATOR']}?job={env['GRADSTAR_JOB']}"
                    "&join_timeout=60")

    def all_reduce(x: np.ndarray):
        t = torch.from_numpy(x)
        dist.all_reduce(t)
        return t.numpy()

    return dist, all_reduce


def run(road: str, fault: str) -> None:
    if road == "torch":
        group, all_reduce = torch_road(fault)
        rank, world, lane = group.get_rank(), group.get_world_size(), None
    else:
        group, all_reduce, lane = gradstar_road(road, fault)
        rank, world = group.rank, group.world_size
    try:
        print(json.dumps(until_failure(rank, world, all_reduce, lane, fault)), flush=True)
    finally:
        with contextlib.suppress(GradstarError):  # the hub may be gone
            group.destroy_process_group() if road == "torch" else group.close()


def until_failure(rank: int, world: int, all_reduce, lane, fault: str) -> dict:
    """Round after round of ``all_reduce`` (checked) until one fails: the report."""
    before = 0 if lane is None else lane.completed
    rounds = 0
    while True:
        n = ELEMENTS + (fault == "mismatch" and rank == world - 1 and rounds >= FAULT_ROUND)
        if fault == "timeout" and rank == 1 and rounds >= FAULT_ROUND:
            sys.stdin.readline()  # the test says when rank 0 has failed
            return {"rank": rank, "rounds": rounds, "error": None}
        try:
            got = all_reduce(np.full(n, rank + 1, np.float32))
        except GradstarError as error:
            return {"rank": rank, "rounds": rounds, "error": type(error).__name__,
                    "message": str(error), "lost_rank": getattr(error, "rank", None),
                    "direct": None if lane is None else lane.completed - before}
        if not np.array_equal(got, np.full(n, world * (world + 1) / 2, np.float32)):
            return {"rank": rank, "rounds": rounds, "error": "wrong result"}
        rounds += 1
        print(json.dumps({"progress": rounds}), flush=True)


def main() -> int:
    run(sys.argv[1], sys.argv[2])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

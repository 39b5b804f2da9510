"""A process group and its collectives, blocking and ``async_op=True``.

Run 4 ranks with an embedded coordinator:

    gradstar launch --nproc 4 examples/process_group.py

``gradstar launch`` starts a coordinator on 127.0.0.1 and gives every rank GRADSTAR_COORDINATOR,
GRADSTAR_JOB, GRADSTAR_WORLD_SIZE and GRADSTAR_RANK, so ``init_process_group()`` needs no
arguments. Without the launcher, pass them yourself:
``gradstar.init_process_group(coordinator="host:29400", job="j", world_size=4, rank=r)``.
Only numpy is needed; torch CPU tensors work the same way (the result has the input's type).
"""

import numpy as np

import gradstar

with gradstar.init_process_group() as pg:  # joins the job; closes (leaves it) at the end
    r, n = pg.rank, pg.world_size

    # Blocking: every rank contributes [r, r, r, r]; the mean is (0 + 1 + ... + n-1) / n.
    mean = pg.all_reduce(np.full(4, r, np.float32), op="mean")

    # async_op=True returns a Work handle at once; the collective runs in the background.
    work = pg.all_gather(np.array([r * r]), async_op=True)
    squares = work.wait()  # a list with one array per rank: [array([0]), array([1]), ...]

    # Rank 0's value reaches everybody.
    seed = pg.broadcast(np.array([1234 if r == 0 else -1]), src=0)

    # reduce_scatter: sum over ranks, then rank r keeps rows r*k .. r*k+k-1 (k = rows / n).
    rows = np.arange(2 * n, dtype=np.float64) + r  # rank r sends [r, r+1, ..., r+2n-1]
    shard = pg.reduce_scatter(rows, op="sum")

    pg.barrier()  # nobody continues until everybody got here
    print(f"process_group: rank {r} of {n}: all_reduce mean {mean[0]:g}, "
          f"all_gather {[int(s[0]) for s in squares]}, broadcast {int(seed[0])}, "
          f"reduce_scatter {shard.tolist()}", flush=True)

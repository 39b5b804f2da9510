"""The asyncio process group: every collective is an awaitable.

    gradstar launch --nproc 4 examples/process_group_async.py

Settings come from the GRADSTAR_* variables that ``gradstar launch`` sets (see
process_group.py). A collective takes its place in the job's order when it is *called*, not
when it is awaited, so several can run at once (``asyncio.gather``) as long as every rank calls
them in the same order.
"""

import asyncio

import numpy as np
import torch

import gradstar


async def main() -> None:
    async with await gradstar.init_process_group_async() as pg:
        r, n = pg.rank, pg.world_size

        # reduce_scatter sums over ranks, then splits dim 0 by rank: 2n rows give 2 per rank.
        # Rank r contributes a tensor filled with r + 1, so every element is 1 + 2 + ... + n.
        shard = await pg.reduce_scatter(torch.full((2 * n, 3), r + 1.0), op="sum")

        # Two collectives in flight together; numbered in call order, so ranks still agree.
        biggest, ranks = await asyncio.gather(
            pg.all_reduce(np.array([float(r)]), op="max"),
            pg.all_gather(np.array([r])),
        )
        print(f"process_group_async: rank {r} of {n}: reduce_scatter {type(shard).__name__} "
              f"{tuple(shard.shape)} of {shard[0, 0].item():g}, all_reduce max "
              f"{biggest[0]:g}, all_gather {[int(a[0]) for a in ranks]}", flush=True)


asyncio.run(main())

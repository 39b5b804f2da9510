"""A DDP rank for the traceml#252 case: ``python backward_straggler_script.py SLOW DELAY STEPS``
(settings from GRADSTAR_* env vars). Every rank trains the same small MLP with gradstar.DDP;
rank SLOW's *backward* alone is slow (a gradient hook on the output sleeps DELAY seconds), its
forward and data are not. A ring all_reduce makes every rank wait the same, so per-rank timings
look alike; the hub sees whose buckets come late. Prints the job's straggler summary as this
rank reads it (``pg.straggler_stats()``) once every collective is in it."""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

import gradstar


def main() -> None:
    slow, delay, steps = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    with gradstar.init_process_group(timeout=60) as pg:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        ddp = gradstar.DDP(model, pg, broadcast_buffers=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for step in range(steps):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            out = ddp(x)
            if pg.rank == slow:  # only this rank's backward is slow
                out.register_hook(lambda grad: time.sleep(delay) or grad)
            out.square().mean().backward()
            opt.step()
        deadline = time.monotonic() + 10
        while True:
            stats = pg.straggler_stats()
            done = all(r.collectives >= steps for r in stats.ranks)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        print(json.dumps(stats.as_dict()), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""An ordinary torchrun training script: nothing in it is gradstar's but ``import gradstar``
and the backend's name. ``init_process_group(backend=...)`` reads torchrun's env:// settings.

usage: torchrun ... torchrun_script.py BACKEND OUT_DIR [--die-once RANK]

Trains torch's DDP on an MLP for a few SGD steps, each rank on its shard of one fixed batch,
and writes ``OUT_DIR/BACKEND-rank{r}.json``: the final parameters, and for gradstar the job
the default group joined and the elastic restart it ran in. With ``--die-once R``, rank R exits
with status 1 in the first round (torchelastic's restart count 0), right after joining.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradstar  # noqa: F401  (registers the backend)

STEPS = 4
BATCH = 24


def main() -> None:
    backend, out = sys.argv[1], Path(sys.argv[2])
    die_once = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--die-once" else None
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if backend == "gradstar":
        from gradstar.client.torch_backend import backend as gradstar_backend

        (group,) = gradstar_backend._live  # the default group: this script makes no other
        (out / f"job-round{restart}-rank{rank}.txt").write_text(group.options["job"])
    if die_once == rank and restart == 0:
        os._exit(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(2))
    per = BATCH // world
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(data[rank * per:(rank + 1) * per]),
                                      target[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
    report = {"rank": rank, "world": world, "restart": restart,
              "params": [p.detach().reshape(-1).tolist() for p in model.parameters()]}
    if backend == "gradstar":
        report["job"] = group.options["job"]
        report["coordinator"] = group.options["coordinator"]
        report["shards"] = list(group.gradstar_group.shards)
        report["reconnect_timeout"] = group.gradstar_group.settings.reconnect_timeout
    (out / f"{backend}-rank{rank}.json").write_text(json.dumps(report))
    # DDP's reducer holds the group: drop it first, so that destroy_process_group joins gloo's
    # worker threads while the interpreter is alive. Otherwise a gloo thread may still destroy
    # a finished work object (which takes the GIL) during finalization, and CPython ends that
    # thread with a forced unwind through torch's C++: SIGABRT, "terminate called without an
    # active exception" (seen in a core dump of the gloo reference run).
    del ddp, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

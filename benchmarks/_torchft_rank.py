"""One torchft replica of ``elastic_torchft.py``'s job: the model, data and loop of
``_elastic_rank.py`` (``_spirals_job``: an MLP on two spirals, Adam, ``--compute`` seconds of
work per step) under
torchft's ``Manager`` (a quorum per step from the lighthouse, gloo for the all_reduce, the
state fetched from a live replica when it joins).

It prints JSON lines: ``imported`` (seconds since process start), ``made`` (model and Adam
built), ``joined`` (the manager and its DDP wrapper made), then one line per committed step this
replica's gradients were part of (not while it heals), with ``t``; every line with ``cpu``
(the process's CPU seconds so far); ``done`` at the end.
"""

from __future__ import annotations

import argparse
import sys
import time

STARTED = time.time()

import torch  # noqa: E402  (after STARTED: the import is part of a joiner's cost)
import torch.distributed as dist  # noqa: E402
from _spirals_job import BATCH, emit, make, spirals  # noqa: E402
from torch import nn  # noqa: E402
from torchft.ddp import DistributedDataParallel  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("ident", type=int)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--compute", type=float, default=0.0)
    parser.add_argument("--grow-at", type=int, default=-1)
    args = parser.parse_args()
    emit({"imported": time.time() - STARTED})
    model, adam = make()
    emit({"made": time.time() - STARTED})
    store = dist.TCPStore(host_name="127.0.0.1", port=0, is_master=True,
                          wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=2,
                      load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                                  adam.load_state_dict(sd["optim"])),
                      state_dict=lambda: {"model": model.state_dict(),
                                          "optim": adam.state_dict()},
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, replica_id=f"r{args.ident}",
                      hostname="127.0.0.1")
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, adam)
    emit({"joined": time.time() - STARTED})
    while (step := manager.current_step()) < args.steps:
        if step == args.grow_at:
            emit({"grow_now": step})
        x, y = spirals(BATCH, torch.Generator().manual_seed(7919 * step + args.ident))
        opt.zero_grad()  # torchft starts the step's quorum here
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()  # the gradients' all_reduce waits for this step's quorum
        contributed = manager.is_participating()  # False while it heals: its gradients zeroed
        opt.step()  # commits when every replica of the quorum did its all_reduce
        time.sleep(args.compute)
        if contributed and manager.current_step() > step:
            emit({"step": step, "t": time.time(), "loss": round(loss.item(), 5)})
    emit({"done": manager.current_step()})
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

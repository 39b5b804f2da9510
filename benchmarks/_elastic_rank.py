"""One rank of ``benchmarks/elastic.py``: ``python _elastic_rank.py MODE IDENT [--leave-at S]
[--grow-at S] --steps N --compute SECONDS`` (settings from GRADSTAR_* env vars).

Trains a small MLP on two interleaved spirals (each rank's batches drawn from (step, IDENT)),
Adam, in ``MODE`` "synchronous" (gradstar.DDP, the job resized at step boundaries), "quorum"
(``Quorum(min_ranks=2, timeout=0.02)``, the job grown on the hub's ledger) or
"streaming-diloco" (a replica named ``rIDENT``: ``StreamingDiLoCo(sync_every=10,
fragments=2, delay=1)``, Adam inside; it joins from the hub's global model and leaves with
``leave()``). It prints one JSON line per step it ran (``{"step", "t", "loss"}``),
``{"grow_now"}`` once at ``--grow-at`` (the driver then starts the joiners), its milestones
(``imported``, ``joined``, ``built``; every line with ``cpu``, the process's CPU seconds so
far) and, unless it left, its final test accuracy (a
replica's: the global model's) and a hash of its parameters (a replica's: the global model).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

STARTED = time.time()

import torch  # noqa: E402  (after STARTED: the import is part of a joiner's cost)
from _spirals_job import BATCH, REPLICA_BATCH, accuracy, emit, make, spirals  # noqa: E402
from torch import nn  # noqa: E402

import gradstar  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("synchronous", "quorum", "streaming-diloco"))
    parser.add_argument("ident", type=int)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--grow-at", type=int, default=-1)
    parser.add_argument("--leave-at", type=int, default=-1)
    parser.add_argument("--compute", type=float, default=0.0)
    args = parser.parse_args()
    emit({"imported": time.time() - STARTED})
    if args.mode == "streaming-diloco":
        return diloco(args)
    pg = gradstar.init_process_group()
    emit({"joined": time.time() - STARTED})
    model, opt = make()
    mode = gradstar.Quorum(min_ranks=2, timeout=0.02) if args.mode == "quorum" else None
    ddp = gradstar.DDP(model, pg, optimizer=opt, sync_mode=mode)
    emit({"built": time.time() - STARTED})

    def step_now() -> int:
        return ddp.sync_stats().step if args.mode == "quorum" else pg.steps_begun

    left = False
    while (step := step_now()) < args.steps:
        if step == args.grow_at:
            emit({"grow_now": step})
        if 0 <= args.leave_at <= step:
            if args.mode == "quorum":
                left = True
                break
            ddp.elastic.leave()
            if ddp.elastic.left:
                left = True
                break
        train_step(ddp, opt, step, args)
    if not left:
        ddp.synchronize()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()
        emit({"accuracy": accuracy(model), "params": digest, "world": pg.world_size})
    pg.close()
    emit({"left": left})
    return 0


def train_step(wrapped, opt, step: int, args, batch: int = BATCH) -> None:
    x, y = spirals(batch, torch.Generator().manual_seed(7919 * step + args.ident))
    loss = nn.functional.cross_entropy(wrapped(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(args.compute)  # the rest of a real step's compute
    emit({"step": step, "t": time.time(), "loss": round(loss.item(), 5)})


def diloco(args) -> int:
    """The replica's loop: its inner steps and ``sdl.step()``; the global model at the end."""
    model, opt = make()
    emit({"made": time.time() - STARTED})
    sdl = gradstar.StreamingDiLoCo(model, sync_every=10, fragments=2, delay=1,
                                   min_replicas=2, round_timeout=60, timeout=120,
                                   replica=f"r{args.ident}")
    emit({"joined": time.time() - STARTED, "at": sdl.joined_at_step,
          "join_rpcs_s": round(sdl.join_seconds, 3)})
    emit({"built": time.time() - STARTED})
    left = False
    with sdl:
        while (step := sdl.local_steps) < args.steps:
            if step == args.grow_at:
                emit({"grow_now": step})
            if 0 <= args.leave_at <= step:
                sdl.leave()
                left = True
                break
            train_step(model, opt, step, args, REPLICA_BATCH)
            sdl.step()
        if not left:
            sdl.finish()
            glob = sdl.global_parameters
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(torch.from_numpy(glob.copy()),
                                                    model.parameters())
            emit({"accuracy": accuracy(model), "params": hashlib.sha256(
                glob.tobytes()).hexdigest(), "world": 0})
    emit({"left": left})
    return 0


if __name__ == "__main__":
    sys.exit(main())

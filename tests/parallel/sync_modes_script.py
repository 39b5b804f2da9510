"""A DDP rank in a sync mode, for tests: ``python sync_modes_script.py MODE [options]``
(settings from GRADSTAR_* env vars).

Trains a small MLP for ``--steps`` iterations with ``gradstar.DDP(sync_mode=...)`` (or
``gradstar.DataParallel(process_group=..., sync_mode=...)`` with ``--data-parallel``) and SGD with
momentum; before each backward the rank sleeps its entry of ``--delays`` (seconds, per rank), and
``--stop-at`` makes a rank stop itself (``kill``: os._exit mid-training; ``stall``: SIGSTOP)
at that iteration (``--await-replacement``: the others wait for the process that takes its
place before their last iteration); ``--leave-rank``/``--leave-at`` make a rank leave the job for
good (close its group) at that iteration, once the job grew. After each backward it prints its
contribution (base, step joined) as a JSON line (with ``--wire``, also its contribution residual
after it); at the end it synchronizes and prints its parameters, the steps it applied (who made
each) and its stats.

:func:`replay` (used by the tests) trains the same model in one process from the hub's record
of which contribution joined which step; with a wire format each contribution is
``roundtrip(fmt, g + residual)`` (error feedback, the residual untouched by a dropped one) and
each aggregate ``roundtrip(fmt, weighted mean)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gradstar.client.steps.hyper import read_hyper, write_hyper
from gradstar.wire.formats import roundtrip

SCRIPT = Path(__file__)
IN, HIDDEN, OUT = 6, 16, 3
BATCH = 8  # per rank and iteration
LR, MOMENTUM = 0.05, 0.9


def make_mlp(batchnorm: bool = False) -> nn.Module:
    """The test model; with ``batchnorm`` a BatchNorm1d after the first layer (float and
    integer buffers)."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(HIDDEN)] if batchnorm else []
    return nn.Sequential(nn.Linear(IN, HIDDEN), *norm, nn.Tanh(), nn.Linear(HIDDEN, OUT))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def batch(rank: int, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + iteration)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT]) + 0.1 * x[:, OUT:]


def loss_of(model: nn.Module, rank: int, iteration: int) -> torch.Tensor:
    x, y = batch(rank, iteration)
    return nn.functional.mse_loss(model(x), y)


def params_of(model: nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().reshape(-1).tolist() for k, v in model.state_dict().items()}


def state_of(ddp, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The rank's step count (aggregates applied), parameters and momentum buffers."""
    momentum = [opt.state[p]["momentum_buffer"].reshape(-1).tolist()
                for p in model.parameters() if "momentum_buffer" in opt.state[p]]
    return {"step": ddp.sync_stats().step, "params": params_of(model), "momentum": momentum}


def mode_of(args):
    import gradstar

    timeout = args.timeout or ("0" if args.mode == "quorum" else "adaptive")
    timeout = None if timeout == "adaptive" else float(timeout)
    if args.mode == "quorum":
        return gradstar.Quorum(min_ranks=args.min_ranks, timeout=timeout)
    options = {"timeout": timeout} if args.scaling is None else {"scaling": args.scaling,
                                                                   "timeout": timeout}
    if args.mode == "bounded":
        return gradstar.BoundedStaleness(max_staleness=args.max_staleness, **options)
    if args.mode == "async":
        return gradstar.Asynchronous(**options)
    return gradstar.Synchronous()


def full_record(steps_of: dict[int, list[dict]]) -> list[dict]:
    """The hub's record of steps 1..N out of the steps each rank applied (rank -> its
    ``recent_steps``): the longest, which must number its steps 1..N; every other rank's must be
    the end of it (a rank that started from the hub's snapshot, in a lost rank's place or after
    other ranks of its start had stepped, applied only the steps after the snapshot)."""
    full = max(steps_of.values(), key=len)
    assert [s["step"] for s in full] == list(range(1, len(full) + 1)), (
        f"no rank applied every step from the first: {[s['step'] for s in full][:5]}...")
    for rank, steps in steps_of.items():
        assert steps == full[len(full) - len(steps):], f"rank {rank} applied other steps"
    return full


def replay(contributions: dict[int, list[dict]], steps: list[dict], wire: str | None = None,
           residuals: dict[int, torch.Tensor] | None = None,
           batchnorm: bool = False) -> nn.Module:
    """One process, the hub's order: step t's aggregate is the weighted mean (rank order) of
    the gradients that joined it, each computed on the parameters after its base aggregates
    with its rank's batch of that iteration; applied with the same optimizer. With ``wire``,
    as the ranks and the hub round (see the module docstring); each rank's residual after its
    last accepted contribution goes into ``residuals``. With ``batchnorm`` each contribution
    also carries its buffers after its forward pass, and each step's weighted mean of them
    becomes the buffers (integers rounded) once the step is applied; a rank's forward starts
    from its base's buffers, or from its previous forward's if it applied no step in between
    (the same base; contributions assumed accepted)."""
    if wire is not None:
        return _replay_wire(contributions, steps, wire,
                            {} if residuals is None else residuals)
    model = make_mlp(batchnorm)
    opt = make_optimizer(model)
    snapshots = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    # (rank, step) -> (iteration, base): which of a rank's iterations joined which step.
    joined = {(rank, c["step"]): (c["iteration"], c["base"]) for rank, cs in contributions.items()
              for c in cs if c["step"] is not None}
    last: dict[int, tuple[int, dict]] = {}  # rank -> (base, buffers) of its last forward
    for entry in steps:
        grads = []
        for rank, weight in zip(entry["ranks"], entry["weights"], strict=True):
            iteration, base = joined[(rank, entry["step"])]
            probe = make_mlp(batchnorm)
            probe.load_state_dict(snapshots[base])
            if batchnorm and last.get(rank, (None,))[0] == base:
                probe.load_state_dict(last[rank][1], strict=False)
            loss_of(probe, rank, iteration).backward()
            last[rank] = (base, {k: b.clone() for k, b in probe.named_buffers()})
            grads.append((weight, torch.cat([
                *(p.grad.reshape(-1) for p in probe.parameters()),
                *(b.reshape(-1).to(torch.float32) for b in probe.buffers())])))
        aggregate = torch.zeros_like(grads[0][1])
        if entry.get("factors"):  # as the hub: each times its factor in float32, rank order;
            # the buffers after the gradient times each weight's share, never scaled
            cut = sum(p.numel() for p in model.parameters())
            top = max(entry["weights"])
            total = math.fsum(w / top for w in entry["weights"]) if top > 0 else 1.0
            for factor, (w, g) in zip(entry["factors"], grads, strict=True):
                share = w / top / total if top > 0 else 1.0 / len(grads)
                aggregate[:cut] += g[:cut] * torch.tensor(factor, dtype=torch.float32)
                aggregate[cut:] += g[cut:] * torch.tensor(share, dtype=torch.float32)
        else:  # Synchronous: the weighted mean
            for w, g in grads:
                aggregate += g * torch.tensor(w, dtype=torch.float32)
            aggregate /= torch.tensor(sum(w for w, _ in grads), dtype=torch.float32)
        offset = 0
        for p in model.parameters():
            p.grad = aggregate[offset:offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
        if entry.get("hyper"):  # the hyperparameters the ranks applied the step with
            write_hyper(opt, read_hyper(opt), entry["hyper"])
        opt.step()
        with torch.no_grad():
            for b in model.buffers():
                part = aggregate[offset:offset + b.numel()].view(b.shape)
                b.copy_(part if b.is_floating_point() else part.round())
                offset += b.numel()
        snapshots[entry["step"]] = {k: v.clone() for k, v in model.state_dict().items()}
    return model


def _replay_wire(contributions, steps, wire: str, residuals: dict) -> nn.Module:
    model = make_mlp()
    opt = make_optimizer(model)
    snapshots = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    # (rank, step) -> (iteration, base, life): a restarted rank's iterations begin at 0 again.
    joined = {(rank, c["step"]): (c["iteration"], c["base"], life)
              for rank, cs in contributions.items()
              for c, life in zip(cs, np.cumsum([c["iteration"] == 0 for c in cs]), strict=True)
              if c["step"] is not None}
    lives: dict[int, int] = {}
    for entry in steps:
        aggregate = np.zeros(sum(p.numel() for p in model.parameters()), np.float32)
        scratch = np.empty_like(aggregate)
        top = max(entry["weights"])
        for rank, factor in zip(entry["ranks"], entry["factors"], strict=True):
            iteration, base, life = joined[(rank, entry["step"])]
            if lives.setdefault(rank, life) != life:
                residuals.pop(rank, None)  # a new process starts from a zero residual
                lives[rank] = life
            probe = make_mlp()
            probe.load_state_dict(snapshots[base])
            loss_of(probe, rank, iteration).backward()
            sent = torch.cat([p.grad.reshape(-1) for p in probe.parameters()])
            sent += residuals.get(rank, torch.zeros_like(sent))
            rounded = roundtrip(wire, sent.numpy())
            residuals[rank] = torch.nan_to_num(sent - torch.from_numpy(rounded), 0.0, 0.0, 0.0)
            # As the hub: times its factor in float32, summed in rank order (all 0: zeros).
            if top > 0:
                np.multiply(rounded, np.float32(factor), out=scratch)
                np.add(aggregate, scratch, out=aggregate)
        values = torch.from_numpy(roundtrip(wire, aggregate))
        offset = 0
        for p in model.parameters():
            p.grad = values[offset:offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
        if entry.get("hyper"):  # the hyperparameters the ranks applied the step with
            write_hyper(opt, read_hyper(opt), entry["hyper"])
        opt.step()
        with torch.no_grad():
            for b in model.buffers():
                part = aggregate[offset:offset + b.numel()].view(b.shape)
                b.copy_(part if b.is_floating_point() else part.round())
                offset += b.numel()
        snapshots[entry["step"]] = {k: v.clone() for k, v in model.state_dict().items()}
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["quorum", "bounded", "async", "sync"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--min-ranks", type=int, default=3)
    parser.add_argument("--timeout", default=None, help="the mode's timeout: seconds, or "
                        "adaptive (default: Quorum 0, the others adaptive)")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--scaling", default=None, help="the ledger modes' step scaling "
                        "(default: the mode's)")
    parser.add_argument("--delays", default="", help="seconds per rank before each backward")
    parser.add_argument("--weights", default="", help="contribution weight per rank")
    parser.add_argument("--stop-rank", type=int, default=-1)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--stop-how", choices=["kill", "stall"], default="kill")
    parser.add_argument("--print-states", action="store_true",
                        help="print the step count, parameters and momentum at the start and "
                             "after every optimizer step")
    parser.add_argument("--wire", default=None, help="DDP's wire format (error feedback on)")
    parser.add_argument("--batchnorm", action="store_true", help="make_mlp(batchnorm=True)")
    parser.add_argument("--data-parallel", type=int, default=0, metavar="N",
                        help="gradstar.DataParallel over N CPU replicas instead of DDP")
    parser.add_argument("--schedule", action="store_true",
                        help="an LR schedule stepped every iteration: lr x 0.8 each time")
    parser.add_argument("--await-replacement", default=None, metavar="PATH",
                        help="a replacement process (an elastic join) creates PATH once a "
                             "contribution of its own was accepted; every other rank waits for "
                             "PATH (up to 120 s) before its last iteration, so the replacement "
                             "joins the steps however slowly it started")
    parser.add_argument("--leave-rank", type=int, default=-1,
                        help="this rank leaves the job for good (closes its group) at "
                             "--leave-at, once the --await-replacement PATH exists (the job "
                             "grew first); it prints its contributions and no parameters")
    parser.add_argument("--leave-at", type=int, default=-1)
    args = parser.parse_args()

    import gradstar

    pg = gradstar.init_process_group(timeout=60)
    rank = pg.rank
    delays = [float(d) for d in args.delays.split(",")] if args.delays else []
    weights = [float(w) for w in args.weights.split(",")] if args.weights else []
    model = make_mlp(args.batchnorm)
    opt = make_optimizer(model)
    if args.data_parallel:  # the whole batch on each process, split over its replicas
        torch.set_num_threads(1)  # the replicas' threads share the cores with the other ranks
        ddp = gradstar.DataParallel(model, device_ids=["cpu"] * args.data_parallel,
                                    process_group=pg, sync_mode=mode_of(args), optimizer=opt)
    else:
        ddp = gradstar.DDP(model, pg, sync_mode=mode_of(args), optimizer=opt, wire=args.wire)
    if weights:
        ddp.contribution_weight = weights[rank]
    schedule = (torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.8 ** i) if args.schedule
                else None)
    if args.print_states:
        print(json.dumps({"rank": rank, "start": state_of(ddp, model, opt)}), flush=True)
    ready = Path(args.await_replacement) if args.await_replacement else None

    def await_ready() -> None:
        deadline = time.monotonic() + 120
        while ready is not None and not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    for i in range(args.steps):
        if rank == args.leave_rank and i == args.leave_at:
            await_ready()
            print(json.dumps({"rank": rank, "left": i}), flush=True)
            pg.close()
            return
        if ready is not None and not pg.replacement and i == args.steps - 1:
            await_ready()
        if rank == args.stop_rank and i == args.stop_at:
            if args.stop_how == "kill":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSTOP)
        opt.zero_grad()
        if delays:
            time.sleep(delays[rank])
        loss_of(ddp, rank, i).backward()
        stats = ddp.sync_stats()
        # Synchronous: every gradient joins the step of its iteration, computed on its base.
        c = stats.recent_contributions[-1] if stats else {"base": i, "step": i + 1,
                                                          "staleness": 0}
        # At once: a rank killed later still leaves the record of what it contributed.
        c = c if isinstance(c, dict) else {"base": c.base, "step": c.step,
                                           "staleness": c.staleness}
        if args.wire:
            residual = ddp.contribution_residual
            c["residual"] = None if residual is None else residual.tolist()
        print(json.dumps({"rank": rank, "contribution": {**c, "iteration": i}}), flush=True)
        if ready is not None and pg.replacement and c["step"] is not None:
            ready.touch()
        opt.step()
        if schedule is not None:
            schedule.step()
        if args.print_states:
            print(json.dumps({"rank": rank, "state": state_of(ddp, model, opt)}), flush=True)
    ddp.synchronize()
    stats = ddp.sync_stats()
    steps = ([{"step": s.step, "ranks": list(s.ranks), "weights": list(s.weights),
               "staleness": list(s.staleness), "hyper": list(s.hyper),
               "factors": list(s.factors)}
              for s in stats.recent_steps] if stats else
             [{"step": i + 1, "ranks": list(range(pg.world_size)),
               "weights": weights or [1.0] * pg.world_size, "staleness": [0] * pg.world_size}
              for i in range(args.steps)])
    print(json.dumps({
        "rank": rank, "params": params_of(model), "steps": steps, "replacement": pg.replacement,
        "applied": stats.steps_applied if stats else args.steps,
        "dropped": stats.dropped if stats else 0,
        "live": list(stats.live_ranks) if stats else [],
    }), flush=True)
    pg.close()


if __name__ == "__main__":
    sys.exit(main())

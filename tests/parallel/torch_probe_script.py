"""A torch.distributed rank that probes what is not a result: how timeouts fire and what torch's
profiler records. For ``test_torch_backend_timeouts.py`` and ``test_torch_backend_profiler.py``.

``python torch_probe_script.py SCENARIO --backend B --init-method URL --rank R --world-size N``
prints one JSON line with the scenario's report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import gradstar  # noqa: F401  (registers backend "gradstar")

SCRIPT = Path(__file__)
#: The default group's timeout in the timeout scenarios: what a group timeout must beat.
DEFAULT_TIMEOUT = 120.0
#: The timeout of the groups that only rank 0 uses.
GROUP_TIMEOUT = 1.0

warnings.filterwarnings("ignore", category=FutureWarning)


def timed(call) -> list:
    """[seconds, error type, error message] of a call expected to time out."""
    started = time.monotonic()
    try:
        call()
        error = None
    except Exception as caught:
        error = caught
    seconds = time.monotonic() - started
    return [seconds, type(error).__name__ if error else None, str(error) if error else None]


def timeouts(rank: int, world: int) -> dict:
    """Rank 0 alone calls each collective of a group created with ``timeout=1 s`` (the default
    group has 120 s); the others never do. Then every rank leaves together."""
    out: dict = {}
    ops = {
        "barrier": lambda g: dist.barrier(group=g),
        "all_reduce": lambda g: dist.all_reduce(torch.ones(3), group=g),
        "broadcast": lambda g: dist.broadcast(torch.ones(3), src=0, group=g),
        "all_gather": lambda g: dist.all_gather([torch.empty(3) for _ in range(world)],
                                                torch.ones(3), group=g),
        "recv": lambda g: dist.recv(torch.empty(3), src=1, group=g),
        # On the group itself: torch's dist.monitored_barrier accepts gloo groups only.
        "monitored_barrier": lambda g: g.monitored_barrier(timedelta(seconds=GROUP_TIMEOUT),
                                                           wait_all_ranks=True),
    }
    # The joins get the default's patience (pg_options): torch's timeout bounds a new group's
    # join too, and a 1 s join would need both ranks to reach each new_group within 1 s of
    # each other, which a loaded machine does not promise; the collectives keep the 1 s.
    groups = {name: dist.new_group(timeout=timedelta(seconds=GROUP_TIMEOUT),
                                   pg_options={"join_timeout": DEFAULT_TIMEOUT})
              for name in ops}
    if rank == 0:
        for name, call in ops.items():
            out[name] = timed(lambda call=call, name=name: call(groups[name]))
    # Nobody leaves before rank 0 is done; on the default group, whose timeout is 120 s.
    dist.barrier()
    return out


def global_timeout(rank: int, world: int, scratch: Path) -> dict:
    """The default group itself has a 1 s timeout (``init_process_group(timeout=...)``): rank 0
    alone calls barrier; the others wait for it to be done (a file) before they leave."""
    done = scratch / "rank0-done"
    if rank == 0:
        report = {"barrier": timed(dist.barrier)}
        done.touch()
        return report
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"saw_rank0_done": done.exists()}


def profiler(rank: int, world: int) -> dict:
    """The events torch's two profilers record for a few collectives (sync and async)."""
    t = torch.ones(3, 4)
    out: dict = {}

    def collectives():
        dist.all_reduce(t)
        dist.broadcast(t, src=0, async_op=True).wait()
        dist.all_gather([torch.empty(3, 4) for _ in range(world)], t)
        dist.barrier()

    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        collectives()
    out["autograd"] = [[e.name, e.input_shapes, e.is_async, e.count]
                       for e in prof.function_events if ":" in e.name
                       and not e.name.startswith(("aten::", "c10d::"))]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        collectives()
    out["kineto"] = [[e.name, e.input_shapes] for e in prof.events() if ":" in e.name
                     and not e.name.startswith(("aten::", "c10d::"))]
    return out


SCENARIOS = {"timeouts": timeouts, "global_timeout": global_timeout, "profiler": profiler}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--backend", required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="init_process_group's timeout")
    parser.add_argument("--scratch", type=Path, help="a folder the ranks share")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, init_method=args.init_method, rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=args.timeout))
    try:
        scenario = SCENARIOS[args.scenario]
        extra = (args.scratch,) if scenario is global_timeout else ()
        report = scenario(args.rank, args.world_size, *extra)
        print(json.dumps({"scenario": args.scenario, "rank": args.rank, **report}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

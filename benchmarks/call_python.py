"""A rank's Python per tiny call, without the hub (issue 36): the SDK against the torch backend.

What is measured
    One process, a job of one rank on a fresh ``gradstar coordinator --shards 0``, the direct
    lane's exchange with the hub replaced by the answer a world of one gets (the input, as the
    result): what is left is the rank's own work per call -- the checks, the header, the plan and
    its message, reading the answer, and on the backend torch's ``dist.all_reduce`` /
    ``dist.barrier`` layers, the backend's argument conversions and its Work. Prints CPU
    microseconds per call (``time.process_time``, ``--calls`` calls after 200 untimed) of:

    * ``sdk all_reduce``: ``pg.all_reduce(x, out=x)`` of a ``--numel``-element float32 array;
    * ``sdk barrier``: ``pg.barrier()``;
    * ``backend all_reduce``: ``dist.all_reduce(t)`` of a float32 CPU tensor of that size, on a
      ``backend="gradstar"`` group;
    * ``backend barrier``: ``dist.barrier()``;

    for ``--repeats`` alternated runs, and the median.

    What a tiny call costs in a running job beyond this is gRPC's and the hub's:
    ``benchmarks/hub_python.py`` measures the hub's Python the same way, ``benchmarks/
    call_floor.py`` gRPC's floor, ``benchmarks/backend_cost.py`` and ``benchmarks/allreduce.py``
    the whole.

How to reproduce
    .venv/bin/python benchmarks/call_python.py                 # 20000 calls x 3
    .venv/bin/python benchmarks/call_python.py --profile /tmp/backend.prof

Not asserted: any timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.distributed as dist
from _processes import CoordinatorProcess

import gradstar
from gradstar.client.collective import direct

WARMUP = 200
_answered = [0]  # calls that reached the direct lane


def _answer_of_one(lane, call, send, out, timeout):
    """What the direct lane returns for a world of one: the rank's own input as the result."""
    _answered[0] += 1
    if send is not None and send is not out:
        out[...] = send
    return out


def _per_call(fn, calls: int) -> float:
    """CPU microseconds per call of ``fn`` over ``calls`` calls."""
    began = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - began) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--numel", type=int, default=25, help="float32 elements (default 25)")
    parser.add_argument("--profile", help="write a cProfile of one run of the backend's "
                                          "all_reduce here")
    args = parser.parse_args()
    direct.DirectLane.run = _answer_of_one
    with CoordinatorProcess(shards=0) as hub:
        address = hub.address
        dist.init_process_group("gradstar", init_method=f"gradstar://{address}?job=calls-torch",
                                rank=0, world_size=1)
        pg = gradstar.init_process_group(coordinator=address, job="calls-sdk", world_size=1,
                                         rank=0)
        x = np.ones(args.numel, np.float32)
        t = torch.ones(args.numel)
        rows = {
            "sdk all_reduce": lambda: pg.all_reduce(x, out=x),
            "sdk barrier": pg.barrier,
            "backend all_reduce": lambda: dist.all_reduce(t),
            "backend barrier": dist.barrier,
        }
        for fn in rows.values():
            for _ in range(WARMUP):
                fn()
        if _answered[0] < len(rows) * WARMUP:
            raise RuntimeError(f"{len(rows) * WARMUP - _answered[0]} warm-up calls did not "
                               "take the direct lane")
        runs: dict[str, list[float]] = {name: [] for name in rows}
        for i in range(args.repeats):
            for name, fn in rows.items():
                runs[name].append(_per_call(fn, args.calls))
            print(f"run {i + 1}: " + ", ".join(f"{name} {v[-1]:.1f}" for name, v in runs.items())
                  + " us", flush=True)
        for name, values in runs.items():
            print(f"{name:20s} median {statistics.median(values):6.1f} us of CPU per call")
        print(f"{args.numel} float32, {args.calls} calls per run, {args.repeats} runs; the hub's "
              "exchange replaced by a world of one's answer; torch "
              f"{torch.__version__}, python {sys.version.split()[0]}")
        if args.profile:
            import cProfile

            cProfile.runctx("run(fn, calls)", {"run": _per_call},
                            {"fn": rows["backend all_reduce"], "calls": args.calls},
                            args.profile)
        pg.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

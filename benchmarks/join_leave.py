"""How long torch.distributed's ``init_process_group`` + ``destroy_process_group`` take, gradstar
vs gloo.

What is measured
    ``--ranks`` spawned processes (default 2, 4 and 8, one after the other) each run ``--rounds``
    rounds of ``init_process_group(backend, ...)``, ``barrier()``, ``destroy_process_group()``
    (the shortest useful life of a group, and what every test of PyTorch's own distributed suite
    does). Every round starts on all ranks at once (a barrier outside the timed part); each rank
    times its join (init + the first barrier, which is when the group is usable) and its leave
    (destroy). The table shows, per world size, the median over rounds of the slowest rank's
    join + leave, and the medians of join and leave, for:

    * gloo: ``init_method="file://..."`` (a fresh file per round);
    * gradstar: a ``gradstar coordinator`` subprocess started once, and
      ``init_method="gradstar://127.0.0.1:PORT?job=..."`` (a fresh job per round);
    * gradstar-store: ``init_method="file://..."`` with no coordinator configured, so rank 0
      starts one for the group through torch's store (see
      ``gradstar.client.torch_backend.store_hub``), as under torchrun's ``env://``.

    The first round of each configuration is a warm-up (imports, first connections) and is not
    counted. Every wait is bounded (``--timeout`` per configuration).

How to reproduce
    .venv/bin/python benchmarks/join_leave.py                      # 2, 4, 8 ranks, 5 rounds
    .venv/bin/python benchmarks/join_leave.py --ranks 2 --rounds 10 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    BenchmarkError,
    CoordinatorProcess,
    add_run_arguments,
    format_table,
    loadavg,
    median,
    run_ranks,
    write_json,
)

CONFIGS = ("gloo", "gradstar", "gradstar-store")
#: Each rank's wait for the others at the start of a round.
ROUND_START_TIMEOUT = 120.0


def rank_body(rank: int, world_size: int, config: str, where: str, rounds: int,
              start) -> list[dict]:
    """One rank: ``rounds`` rounds of join, barrier, leave; seconds per round."""
    from datetime import timedelta

    import torch.distributed as dist

    import gradstar.client.torch_backend  # noqa: F401  (registers backend "gradstar")

    os.environ.pop("GRADSTAR_COORDINATOR", None)
    backend = "gloo" if config == "gloo" else "gradstar"
    times = []
    for round_ in range(rounds):
        if config == "gradstar":
            init_method = f"gradstar://{where}?job=jl-{world_size}-{round_}"
        else:
            init_method = f"file://{where}/{config}-{world_size}-{round_}"
        start.wait(ROUND_START_TIMEOUT)
        t0 = time.perf_counter()
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        dist.barrier()
        t1 = time.perf_counter()
        dist.destroy_process_group()
        t2 = time.perf_counter()
        times.append({"join": t1 - t0, "leave": t2 - t1})
    return times


def run_config(config: str, world_size: int, rounds: int, timeout: float) -> list[list[dict]]:
    import multiprocessing as mp

    start = mp.get_context("spawn").Barrier(world_size)
    with tempfile.TemporaryDirectory(prefix="join-leave-") as folder:
        if config == "gradstar":
            with CoordinatorProcess() as hub:
                return run_ranks(rank_body, world_size, (config, hub.address, rounds, start),
                                 timeout=timeout, label=f"{config} x{world_size}")
        return run_ranks(rank_body, world_size, (config, folder, rounds, start),
                         timeout=timeout, label=f"{config} x{world_size}")


def summarize(per_rank: list[list[dict]]) -> dict:
    """Medians over the counted rounds (all but the first) of the slowest rank's total and of
    every rank's join and leave, in milliseconds."""
    rounds = range(1, len(per_rank[0]))
    slowest = [max(r[i]["join"] + r[i]["leave"] for r in per_rank) for i in rounds]
    joins = [r[i]["join"] for r in per_rank for i in rounds]
    leaves = [r[i]["leave"] for r in per_rank for i in rounds]
    return {"total_ms": median(slowest) * 1e3, "join_ms": median(joins) * 1e3,
            "leave_ms": median(leaves) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds per configuration, the first one uncounted (>= 2)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    add_run_arguments(parser, timeout=300.0)
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first round is a warm-up)")
    print(f"load average before: {loadavg()}", file=sys.stderr)
    results: dict[str, dict] = {}
    failures = []
    for world_size in args.ranks:
        for config in args.configs:
            name = f"{config} x{world_size}"
            t0 = time.monotonic()
            try:
                results[name] = summarize(run_config(config, world_size, args.rounds,
                                                     args.timeout))
                print(f"  {name:20s} {results[name]['total_ms']:8.1f} ms "
                      f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
            except BenchmarkError as error:
                failures.append((name, str(error)))
                print(f"  {name:20s} FAILED", file=sys.stderr, flush=True)
    rows = []
    for world_size in args.ranks:
        row: list[object] = [world_size]
        for config in args.configs:
            got = results.get(f"{config} x{world_size}")
            row.append("FAILED" if got is None else
                       f"{got['total_ms']:.0f} ({got['join_ms']:.0f}+{got['leave_ms']:.0f})")
        rows.append(row)
    print("init_process_group + barrier + destroy_process_group, ms: median over rounds of the "
          "slowest rank (median join + median leave)")
    print(format_table(["ranks", *args.configs], rows))
    print(f"load average after: {loadavg()}", file=sys.stderr)
    if args.json:
        write_json(args, "join_leave", results=results, failures=failures,
                   run=uuid.uuid4().hex)
    for name, error in failures:
        print(f"\n{name} failed: {error}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""``gradstar demo``: an embedded coordinator and N local rank processes run real collectives.

Each rank all-reduces a tensor whose exact sum is known, gathers and broadcasts, and the demo
prints what every rank measured and whether every result was exact. (The training demo of the
runtime issue will replace this as the main job.)
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import numpy as np

JOB = "demo"


def _rank_main(address: str, world_size: int, rank: int, elements: int, rounds: int, results):
    import gradstar

    try:
        with gradstar.init_process_group(coordinator=address, job=JOB, world_size=world_size,
                                         rank=rank, timeout=120) as pg:
            x = np.arange(elements, dtype=np.float32) % 1024 + rank
            expected = (np.arange(elements, dtype=np.float32) % 1024) * world_size + sum(
                range(world_size))
            exact, times = True, []
            for _ in range(rounds):
                pg.barrier()
                start = time.perf_counter()
                out = pg.all_reduce(x, op="sum")
                times.append(time.perf_counter() - start)
                exact &= bool(np.array_equal(out, expected))
            gathered = pg.all_gather(np.array([rank], dtype=np.int64))
            exact &= [int(g[0]) for g in gathered] == list(range(world_size))
            token = pg.broadcast(np.array([rank * 7 + 3], dtype=np.int64), src=world_size - 1)
            exact &= int(token[0]) == (world_size - 1) * 7 + 3
            results.put((rank, exact, times, None))
    except Exception as error:  # reported by the parent, which exits non-zero
        results.put((rank, False, [], f"{type(error).__name__}: {error}"))


def run_demo(workers: int = 4, megabytes: float = 16.0, rounds: int = 5) -> int:
    from gradstar.coordinator import EmbeddedCoordinator

    elements = max(1, int(megabytes * (1 << 20)) // 4)
    with EmbeddedCoordinator() as hub:
        print(f"gradstar demo: coordinator on {hub.address}, {workers} ranks, "
              f"all_reduce of {elements * 4 / (1 << 20):.1f} MB float32 x {rounds} rounds")
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank_main,
                             args=(hub.address, workers, r, elements, rounds, results))
                 for r in range(workers)]
        for p in procs:
            p.start()
        reports = _collect(results, procs, deadline=time.monotonic() + 300)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return _report(reports, procs, elements)


def _collect(results, procs, deadline: float) -> dict:
    reports: dict = {}
    while len(reports) < len(procs) and time.monotonic() < deadline:
        try:
            rank, exact, times, error = results.get(timeout=1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            continue
        reports[rank] = (exact, times, error)
    return reports


def _report(reports: dict, procs, elements: int) -> int:
    failed = False
    print(f"{'rank':>4}  {'median all_reduce':>17}  {'algbw':>10}  result")
    for rank in range(len(procs)):
        if rank not in reports:
            code = procs[rank].exitcode
            print(f"{rank:>4}  {'-':>17}  {'-':>10}  no report (process exit code {code})")
            failed = True
            continue
        exact, times, error = reports[rank]
        if error:
            print(f"{rank:>4}  {'-':>17}  {'-':>10}  FAILED: {error}")
            failed = True
            continue
        median = float(np.median(times))
        print(f"{rank:>4}  {median * 1e3:>14.1f} ms  {elements * 4 / median / 1e9:>6.2f} GB/s  "
              f"{'exact' if exact else 'WRONG'}")
        failed |= not exact
    print("demo " + ("FAILED" if failed else "passed: every collective result was exact"))
    return 1 if failed else 0

"""Riding through coordinator restarts: how long ranks wait, and what holding their inputs costs.

What is measured
    **Restarts.** A ``gradstar coordinator`` process and ``--ranks`` rank processes, each
    running in-place all_reduce calls of ``--mib`` MiB in a loop and timing every completion.
    ``--kills`` times, the coordinator is killed (SIGKILL) and, ``--away`` seconds later,
    started again on the same port. Per restart the table shows, over the ranks, the slowest
    rank's *wait* (from the kill until its session rejoined: ``pg.reconnects``) and its
    *resume* (from the restarted coordinator's "listening" line until that rank's first
    collective completed after the kill), and every rank's results are checked exactly.
    **Holding inputs.** In one process, 2 ranks of one job run ``--rounds`` in-place all_reduce
    calls of ``--copy-mib`` MiB with ``reconnect_timeout`` 0 (nothing held: the reference) and
    30 (each input copied when issued, kept until no rank can need it), taking turns; then
    50 times as many all_reduce calls of 100 bytes (not in place: held, not copied). Each line
    shows the two median times per call and their ratio.

How to reproduce
    .venv/bin/python benchmarks/ride_through.py                   # 4 ranks, 3 kills
    .venv/bin/python benchmarks/ride_through.py --ranks 4 --kills 10 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

LISTENING = "gradstar coordinator listening on "


def coordinator(port: int) -> tuple[subprocess.Popen, str, float]:
    """A coordinator process on ``port`` (0: any); it, its address, when it listened."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port",
         str(port), "--shards", "0", "--log-level", "ERROR"], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the coordinator exited before it listened")
        if line.startswith(LISTENING):
            return proc, line.split()[-1], time.time()
    proc.kill()
    raise RuntimeError("the coordinator did not listen within 60 s")


def rank_main(ops: int, mib: float) -> None:
    """One rank (GRADSTAR_* env): ``ops`` in-place all_reduce calls, each checked; prints its
    completion times and rides through as JSON."""
    import gradstar

    n = int(mib * (1 << 20)) // 4
    with gradstar.init_process_group(timeout=120) as pg:
        done, ok = [], True
        for i in range(ops):
            x = np.full(n, float(pg.rank + i), np.float32)
            pg.all_reduce(x, out=x)
            ok &= bool(x[0] == x[-1] == sum(r + i for r in range(pg.world_size)))
            done.append(time.time())
            print("op", flush=True)
        print(json.dumps({"done": done, "waits": pg.reconnects, "ok": ok}), flush=True)


def restarts(ranks: int, kills: int, away: float, mib: float, per_phase: int) -> list[dict]:
    hub, address, _ = coordinator(0)
    port = int(address.rsplit(":", 1)[1])
    env = {**os.environ, "GRADSTAR_COORDINATOR": address, "GRADSTAR_JOB": "ride",
           "GRADSTAR_WORLD_SIZE": str(ranks), "GRADSTAR_RECONNECT_TIMEOUT": "60"}
    ops = per_phase * (kills + 1)
    procs = [subprocess.Popen([sys.executable, __file__, "rank", str(ops), str(mib)],
                              env={**env, "GRADSTAR_RANK": str(r)}, stdout=subprocess.PIPE,
                              text=True) for r in range(ranks)]
    events = []
    try:
        for _ in range(kills):
            for _ in range(per_phase):
                assert procs[0].stdout.readline().startswith("op"), "rank 0 stopped"
            killed = time.time()
            hub.send_signal(signal.SIGKILL)
            hub.wait(30)
            time.sleep(away)
            hub, _, listening = coordinator(port)
            events.append((killed, listening))
        lines = [p.communicate(timeout=600)[0].strip().splitlines()[-1] for p in procs]
    finally:
        for p in (*procs, hub):
            if p.poll() is None:
                p.kill()
    reports = [json.loads(line) for line in lines]
    assert all(r["ok"] for r in reports), "a rank got a wrong result"
    rows = []
    for k, (killed, listening) in enumerate(events):
        resume = max(min(t for t in r["done"] if t > killed) - listening for r in reports)
        rows.append({"kill": k + 1, "wait_s": max(r["waits"][k] for r in reports),
                     "resume_after_listening_s": resume})
    return rows


async def copy_cost(mib: float, rounds: int, in_place: bool = True) -> dict:
    import gradstar
    from gradstar.config import CoordinatorSettings
    from gradstar.coordinator import Coordinator

    hub = Coordinator(CoordinatorSettings(host="127.0.0.1", port=0))
    await hub.start()
    n = max(1, int(mib * (1 << 20)) // 4)
    times: dict[float, list[float]] = {0.0: [], 30.0: []}
    try:
        jobs = {timeout: await asyncio.gather(*(gradstar.init_process_group_async(
            coordinator=hub.address, job=f"copy-{timeout}", world_size=2, rank=r,
            reconnect_timeout=timeout) for r in range(2))) for timeout in times}
        xs = [np.ones(n, np.float32) for _ in range(2)]
        for i in range(rounds + 1):  # the two settings in turn, so that load hits both alike
            for timeout, groups in jobs.items():
                started = time.perf_counter()
                await asyncio.gather(*(g.all_reduce(x, out=x if in_place else None)
                                       for g, x in zip(groups, xs, strict=True)))
                if i:  # the first round warms up
                    times[timeout].append(time.perf_counter() - started)
        for groups in jobs.values():
            await asyncio.gather(*(g.close() for g in groups))
    finally:
        await hub.stop(grace=0)
    medians = {timeout: statistics.median(t) for timeout, t in times.items()}
    return {"mib": mib, "in_place": in_place, "off_ms": medians[0.0] * 1e3,
            "riding_ms": medians[30.0] * 1e3, "ratio": medians[30.0] / medians[0.0]}


def main() -> None:
    if sys.argv[1:2] == ["rank"]:
        rank_main(int(sys.argv[2]), float(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--away", type=float, default=1.0)
    parser.add_argument("--mib", type=float, default=1.0)
    parser.add_argument("--per-phase", type=int, default=20)
    parser.add_argument("--copy-mib", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = restarts(args.ranks, args.kills, args.away, args.mib, args.per_phase)
    print(f"{args.ranks} ranks, in-place all_reduce of {args.mib:g} MiB, coordinator killed "
          f"{args.kills} times, started again {args.away:g} s later "
          f"(load {os.getloadavg()[0]:.1f})")
    print(f"{'kill':>4}  {'slowest wait (s)':>16}  {'resume after listening (s)':>26}")
    for row in rows:
        print(f"{row['kill']:>4}  {row['wait_s']:>16.2f}  {row['resume_after_listening_s']:>26.2f}")
    costs = [asyncio.run(copy_cost(args.copy_mib, args.rounds)),
             asyncio.run(copy_cost(100 / (1 << 20), args.rounds * 50, in_place=False))]
    for cost in costs:
        what = (f"in-place all_reduce of {cost['mib']:g} MiB" if cost["in_place"]
                else f"all_reduce of {cost['mib'] * (1 << 20):.0f} B")
        print(f"{what}, 2 ranks: reconnect_timeout 0 {cost['off_ms']:.3f} ms, 30 "
              f"{cost['riding_ms']:.3f} ms: {cost['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"restarts": rows, "holding": costs}, f, indent=1)


if __name__ == "__main__":
    main()

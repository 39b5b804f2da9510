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

    **Takeovers** (``--ha``): a real etcd, two ``gradstar coordinator --ha`` processes (one
    leads, one stands by) and the ranks given both addresses. ``--kills`` times, alternately
    the leader and the standby is killed (SIGKILL) and started again on its port as the
    standby. Per leader killed the table shows the *takeover* (from the kill to the standby's
    "listening" line: the lease running out, ``--ttl``, and the standby's next poll), and the
    slowest rank's *resume* from the kill and from that line until its next completed
    collective; per standby killed, the ranks' longest pause between two completions around
    it (a standby carries nothing, so this is the loop's own pace). Every result is checked.

How to reproduce
    .venv/bin/python benchmarks/ride_through.py                   # 4 ranks, 3 kills
    .venv/bin/python benchmarks/ride_through.py --ranks 4 --kills 10 --json out.json
    .venv/bin/python benchmarks/ride_through.py --ha --ranks 4 --kills 10 --ttl 5
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
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

LISTENING = "gradstar coordinator listening on "
STANDBY = "gradstar coordinator standby on "


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


def rank_main(ops: int, mib: float, pause: float = 0.0, stop: str = "") -> None:
    """One rank (GRADSTAR_* env): ``ops`` in-place all_reduce calls, each checked, ``pause``
    seconds apart (with ``stop``: until rank 0 finds that file, which a 4-byte all_reduce
    after each call tells every rank); prints its completion times and rides through as
    JSON."""
    import gradstar

    n = int(mib * (1 << 20)) // 4
    with gradstar.init_process_group(timeout=120) as pg:
        done, ok, i = [], True, 0
        while (i < ops) if not stop else True:
            x = np.full(n, float(pg.rank + i), np.float32)
            pg.all_reduce(x, out=x)
            ok &= bool(x[0] == x[-1] == sum(r + i for r in range(pg.world_size)))
            done.append(time.time())
            print("op", flush=True)
            i += 1
            if stop:
                flag = np.array([pg.rank == 0 and os.path.exists(stop)], np.float32)
                if pg.all_reduce(flag)[0] > 0:
                    break
            time.sleep(pause)
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


def _last_line(proc: subprocess.Popen) -> str:
    """The last line a rank prints (its report), read to its end line by line: text mode's
    read-ahead would hide from communicate() what readline() already buffered."""
    last = ""
    for line in proc.stdout:
        last = line
    proc.wait(60)
    return last.strip()


class Watched:
    """A ``gradstar coordinator --ha`` process whose stdout lines are kept with the time each
    arrived (a thread reads them)."""

    def __init__(self, etcd: str, port: int, ttl: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port",
             str(port), "--shards", "0", "--log-level", "ERROR", "--ha", etcd, "--ha-ttl",
             str(ttl)], stdout=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()
        _, line = self.wait_for(LISTENING, STANDBY)
        self.address = line.split()[-1] if line.startswith(LISTENING) else line.split()[4]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def wait_for(self, *starts: str, seconds: float = 60) -> tuple[float, str]:
        """When the first line starting with one of ``starts`` arrived, and the line."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for at, line in self.lines:
                if line.startswith(starts):
                    return at, line
            if self.proc.poll() is not None and not self.lines:
                break
            time.sleep(0.01)
        raise RuntimeError(f"the coordinator did not print {starts[0]!r} within {seconds} s")


def takeovers(ranks: int, kills: int, mib: float, per_phase: int, ttl: int) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks._etcd import start_etcd, stop_etcd

    with tempfile.TemporaryDirectory(prefix="gs-ha-") as tmp:
        etcd_proc, etcd = start_etcd(Path(tmp))
        hubs = [Watched(etcd, 0, ttl)]
        hubs.append(Watched(etcd, 0, ttl))
        ports = [int(h.address.rsplit(":", 1)[1]) for h in hubs]
        env = {**os.environ, "GRADSTAR_COORDINATOR": ",".join(h.address for h in hubs),
               "GRADSTAR_JOB": "ha", "GRADSTAR_WORLD_SIZE": str(ranks),
               "GRADSTAR_RECONNECT_TIMEOUT": "60"}
        stop = Path(tmp) / "stop"
        procs = [subprocess.Popen([sys.executable, __file__, "rank", "0", str(mib), "0.05",
                                   str(stop)], env={**env, "GRADSTAR_RANK": str(r)},
                                  stdout=subprocess.PIPE, text=True) for r in range(ranks)]
        leader, events = 0, []
        try:
            for k in range(kills):
                for _ in range(per_phase):
                    assert procs[0].stdout.readline().startswith("op"), "rank 0 stopped"
                victim = leader if k % 2 == 0 else 1 - leader
                killed = time.time()
                hubs[victim].proc.kill()
                hubs[victim].proc.wait(30)
                listening = None
                if victim == leader:
                    leader = 1 - leader
                    listening, _ = hubs[leader].wait_for(LISTENING)
                hubs[victim] = Watched(etcd, ports[victim], ttl)
                events.append((killed, listening, time.time()))
            stop.touch()
            lines = [_last_line(p) for p in procs]
        finally:
            for p in (*procs, *(h.proc for h in hubs)):
                if p.poll() is None:
                    p.kill()
            stop_etcd(etcd_proc)
    reports = [json.loads(line) for line in lines]
    assert all(r["ok"] for r in reports), "a rank got a wrong result"
    rows = []
    for k, (killed, listening, back) in enumerate(events):
        row: dict = {"kill": k + 1, "victim": "leader" if listening else "standby"}
        if listening:
            first = max(min(t for t in r["done"] if t > killed) for r in reports)
            row.update(takeover_s=listening - killed, resume_after_kill_s=first - killed,
                       resume_after_listening_s=first - listening)
        else:  # the longest gap between two completions that overlaps the kill and restart
            gaps = [(b - a, a - killed) for r in reports
                    for a, b in zip(r["done"], r["done"][1:], strict=False)
                    if b > killed and a < back]
            row["longest_pause_s"], row["pause_began_after_kill_s"] = max(gaps)
            row["standby_back_after_kill_s"] = back - killed
        rows.append(row)
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
        rank_main(int(sys.argv[2]), float(sys.argv[3]), *(f(a) for f, a in zip(
            (float, str), sys.argv[4:], strict=False)))
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
    parser.add_argument("--ha", action="store_true",
                        help="takeovers by a standby through etcd instead of restarts")
    parser.add_argument("--ttl", type=int, default=5, help="--ha: the leader's lease (s)")
    args = parser.parse_args()
    if args.ha:
        ha_main(args)
        return
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


def ha_main(args: argparse.Namespace) -> None:
    rows = takeovers(args.ranks, args.kills, args.mib, args.per_phase, args.ttl)
    print(f"{args.ranks} ranks, in-place all_reduce of {args.mib:g} MiB, two coordinators "
          f"under --ha (lease {args.ttl} s), {args.kills} kills alternating leader and standby "
          f"(load {os.getloadavg()[0]:.1f})")
    print(f"{'kill':>4}  {'victim':>7}  {'takeover (s)':>12}  {'resume after kill (s)':>21}  "
          f"{'after listening (s)':>19}  {'longest pause (s)':>17}")
    for row in rows:
        if row["victim"] == "leader":
            print(f"{row['kill']:>4}  {'leader':>7}  {row['takeover_s']:>12.2f}  "
                  f"{row['resume_after_kill_s']:>21.2f}  "
                  f"{row['resume_after_listening_s']:>19.2f}  {'':>17}")
        else:
            print(f"{row['kill']:>4}  {'standby':>7}  {'':>12}  {'':>21}  {'':>19}  "
                  f"{row['longest_pause_s']:>17.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"takeovers": rows, "ttl": args.ttl}, f, indent=1)


if __name__ == "__main__":
    main()

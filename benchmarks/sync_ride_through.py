"""Sync modes and Streaming DiLoCo across coordinator kills: final accuracy against undisturbed
runs (issue 50's targets for Quorum and Streaming DiLoCo).

The run
    ``--ranks`` processes of ``_elastic_rank.py`` train its spirals MLP (Adam) to ``--steps``
    steps: ``quorum`` (``gradstar.DDP(sync_mode=Quorum(min_ranks=2, timeout=0.02))``) or
    ``streaming-diloco`` (replicas of ``StreamingDiLoCo(sync_every=10, fragments=2,
    delay=1)``), every rank with ``GRADSTAR_RECONNECT_TIMEOUT=60``, on one ``gradstar
    coordinator`` (with a ``--state-dir``) or, with ``--ha``, two under a real etcd sharing one
    ``--state-dir``. ``--kills`` times, evenly over the run (when rank 0 passes the step), the
    coordinator is killed (SIGKILL) and started again on its port ``--away`` seconds later;
    under ``--ha`` the leader and the standby are killed in turns (the standby takes over from
    a killed leader; each killed one comes back as the standby). The same job also runs
    ``--clean`` times undisturbed (the reference, and the runs' own spread).

What is printed (nothing asserted; ``--json`` saves it)
    Per run: kills, wall seconds, each rank's final test accuracy, whether the ranks' final
    parameters are bitwise identical (DDP; a replica reports the global model), how many
    times each rank rode through, and tracebacks in the ranks' stderr (must be 0). Then the
    disturbed runs' accuracy less the undisturbed runs' mean, in points, next to the spread of
    the undisturbed runs themselves.

Run: ``.venv/bin/python benchmarks/sync_ride_through.py --mode quorum --kills 1``
     ``.venv/bin/python benchmarks/sync_ride_through.py --mode quorum --ha --kills 10``
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _etcd import start_etcd, stop_etcd
from _harness import format_table, loadavg

RANK = Path(__file__).with_name("_elastic_rank.py")
LISTENING = "gradstar coordinator listening on "
STANDBY = "gradstar coordinator standby on "


class Hub:
    """A ``gradstar coordinator`` process (``--ha``: under etcd) whose stdout lines a thread
    keeps; its address once it listened or stood by."""

    def __init__(self, port: int, state: Path, etcd: str | None, ttl: int) -> None:
        ha = ["--ha", etcd, "--ha-ttl", str(ttl)] if etcd else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port",
             str(port), "--shards", "0", "--log-level", "ERROR", "--state-dir", str(state),
             *ha], stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        line = self.wait_for(LISTENING, STANDBY)
        self.address = line.split()[-1] if line.startswith(LISTENING) else line.split()[4]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, *starts: str, seconds: float = 60) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(starts):
                    return line
            time.sleep(0.02)
        raise RuntimeError(f"the coordinator did not print {starts[0]!r} within {seconds} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def run(args, kills: int, tmp: Path) -> dict:
    """One run of the job with ``kills`` coordinator kills; what the module docstring lists."""
    etcd_proc, etcd = start_etcd(tmp) if args.ha else (None, None)
    state = tmp / "state"
    hubs = [Hub(0, state, etcd, args.ttl) for _ in range(2 if args.ha else 1)]
    ports = [int(h.address.rsplit(":", 1)[1]) for h in hubs]
    env = {**os.environ, "GRADSTAR_COORDINATOR": ",".join(h.address for h in hubs),
           "GRADSTAR_JOB": "ride", "GRADSTAR_WORLD_SIZE": str(args.ranks),
           "GRADSTAR_RECONNECT_TIMEOUT": "60", "GRADSTAR_TIMEOUT": "120"}
    errs = [tmp / f"rank{r}.err" for r in range(args.ranks)]
    procs = [subprocess.Popen(
        [sys.executable, str(RANK), args.mode, str(r), "--steps", str(args.steps),
         "--compute", str(args.compute)], env={**env, "GRADSTAR_RANK": str(r)},
        stdout=subprocess.PIPE, stderr=errs[r].open("w"), text=True) for r in range(args.ranks)]
    began, lines, leader = time.monotonic(), [], 0
    at = [args.steps * (k + 1) // (kills + 1) for k in range(kills)]
    try:
        for k, step in enumerate(at):
            while True:  # rank 0's lines until it passed the step
                line = procs[0].stdout.readline()
                if not line:
                    raise RuntimeError("rank 0 exited before the kills were done")
                lines.append(line)
                if json.loads(line).get("step", -1) >= step:
                    break
            victim = leader if (k % 2 == 0 or not args.ha) else 1 - leader
            hubs[victim].kill()
            if args.ha and victim == leader:
                leader = 1 - leader
                hubs[leader].wait_for(LISTENING)
            else:
                time.sleep(args.away)
            hubs[victim] = Hub(ports[victim], state, etcd, args.ttl)
        out, _ = procs[0].communicate(timeout=600)
        reports = [lines + out.splitlines()] + [p.communicate(timeout=600)[0].splitlines()
                                                for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for h in hubs:
            h.kill()
        if etcd_proc is not None:
            stop_etcd(etcd_proc)
    finals = [next(json.loads(x) for x in reversed(r) if '"accuracy"' in x) for r in reports]
    stderr = [e.read_text() for e in errs]
    return {"kills": kills, "seconds": round(time.monotonic() - began, 1),
            "accuracy": [round(f["accuracy"], 4) for f in finals],
            "identical": len({f["params"] for f in finals}) == 1,
            "rides": [err.count("rejoined the coordinator at") for err in stderr],
            "tracebacks": sum(err.count("Traceback") for err in stderr),
            "codes": [p.returncode for p in procs]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("quorum", "streaming-diloco"), default="quorum")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kills", type=int, default=1)
    parser.add_argument("--clean", type=int, default=2, help="undisturbed runs")
    parser.add_argument("--away", type=float, default=1.0)
    parser.add_argument("--compute", type=float, default=0.01,
                        help="seconds of extra compute per step")
    parser.add_argument("--ha", action="store_true")
    parser.add_argument("--ttl", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs = []
    for kills in [0] * args.clean + [args.kills]:
        with tempfile.TemporaryDirectory(prefix="gs-ride-") as tmp:
            runs.append(run(args, kills, Path(tmp)))
        print(json.dumps(runs[-1]), flush=True)
    clean = [statistics.mean(r["accuracy"]) for r in runs if r["kills"] == 0]
    reference = statistics.mean(clean)
    rows = [[r["kills"], r["seconds"], " ".join(f"{a:.4f}" for a in r["accuracy"]),
             f"{100 * (statistics.mean(r['accuracy']) - reference):+.2f}", r["identical"],
             " ".join(map(str, r["rides"])), r["tracebacks"]] for r in runs]
    print(f"{args.mode}, {args.ranks} ranks, {args.steps} steps, "
          f"{'--ha (ttl ' + str(args.ttl) + ')' if args.ha else 'restarted'}; "
          f"load {loadavg()}")
    print(format_table(["kills", "s", "accuracy per rank", "vs clean mean (points)",
                        "identical", "rides per rank", "tracebacks"], rows))
    print(f"undisturbed runs' spread: {100 * (max(clean) - min(clean)):.2f} points")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

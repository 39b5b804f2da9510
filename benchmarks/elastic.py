"""A job that grows 4 -> 6 ranks and shrinks 6 -> 3 while it trains, in Synchronous DDP (the
job resized at step boundaries), in Quorum (grown on the hub's step ledger) and in Streaming
DiLoCo (replicas that join from the hub's global model and leave), against the same job at a
fixed 4 ranks.

What is measured
    A ``gradstar coordinator`` subprocess and 4 rank processes (``_elastic_rank.py``: an MLP on
    two spirals, Adam, ``--compute`` seconds of simulated work per step). When rank 0 reaches
    step ``--grow-at`` two more processes start (``GRADSTAR_ELASTIC=1``, no rank); at step
    ``--leave-at`` three ranks (two of the first, one newcomer) leave for good; every other rank
    stops at ``--steps``. No process is restarted. Per mode:

    * **join**: from a newcomer's process start (``Popen``) to the end of its first step (its
      first gradient in a step), with the parts: imports, ``init_process_group`` (which waits
      for the boundary), ``gradstar.DDP`` (the state it receives); and the CPU seconds the
      newcomer's process used until then (imports' share in brackets): what the join costs
      whatever else the machine runs, so that the time on a host with one core to spare is
      about that;
    * **pause**: the longest gap between two steps on rank 0 over the run, less its median
      step (what the resizes cost the ranks already there);
    * **accuracy** on 4000 held-out points, elastic and fixed-size, and whether every rank that
      finished ends with bitwise the same parameters.

    Each configuration runs ``--runs`` times; the table shows every run.

How to reproduce
    .venv/bin/python benchmarks/elastic.py                    # both modes, 2 runs each
    .venv/bin/python benchmarks/elastic.py --modes synchronous --runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import BenchmarkError, CoordinatorProcess, format_table, loadavg, write_json
from _processes import kill_and_reap, track

RANK = Path(__file__).resolve().parent / "_elastic_rank.py"
FIRST, JOINERS, LEAVERS = 4, (4, 5), (1, 3, 5)


class Rank:
    """One rank process (``script``, ``_elastic_rank.py`` unless said) and its JSON lines,
    read on a thread."""

    def __init__(self, ident: int, argv: list[str], env: dict, on_line=None,
                 script: Path = RANK) -> None:
        self.ident, self.lines = ident, []
        self.spawned = time.time()
        self.proc = subprocess.Popen([sys.executable, str(script), *argv], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        track(self.proc)
        self._on_line = on_line
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                record = json.loads(line)
                self.lines.append(record)
                if self._on_line is not None:
                    self._on_line(record)

    def wait(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            kill_and_reap(self.proc)
            raise BenchmarkError(f"rank {self.ident} did not finish in time; its last lines: "
                                 f"{self.lines[-3:]}\n{self.proc.stderr.read()[-3000:]}") from None
        self._reader.join(timeout=10)
        if self.proc.returncode != 0:
            raise BenchmarkError(f"rank {self.ident} exited with {self.proc.returncode}:\n"
                                 f"{self.proc.stderr.read()[-3000:]}")

    def first(self, key: str, field: str | None = None):
        """The first line's ``key`` (or its ``field``: ``first("joined", "cpu")``)."""
        return next((line[field or key] for line in self.lines if key in line), None)

    def milestones_cpu(self) -> dict:
        """CPU seconds at each milestone the rank printed (where a join's CPU goes)."""
        return {k: self.first(k, "cpu") for k in ("imported", "made", "joined", "built")
                if self.first(k) is not None}


def run(mode: str, elastic: bool, args) -> dict:
    with CoordinatorProcess(shards=0, log_level=os.environ.get("ELASTIC_LOG", "WARNING")) as coord:
        print("coordinator log:", coord.log_path, file=sys.stderr)
        env = os.environ | {"GRADSTAR_COORDINATOR": coord.address, "GRADSTAR_JOB": "elastic",
                            "GRADSTAR_WORLD_SIZE": str(FIRST), "GRADSTAR_TIMEOUT": "120"}
        if elastic:
            env |= {"GRADSTAR_MAX_WORLD_SIZE": str(FIRST + len(JOINERS)),
                    "GRADSTAR_MIN_WORLD_SIZE": "2"}
        common = [mode, "--steps", str(args.steps), "--compute", str(args.compute)]
        ranks: list[Rank] = []
        grow = threading.Event()

        def flags(ident: int) -> list[str]:
            out = []
            if elastic and ident == 0:
                out += ["--grow-at", str(args.grow_at)]
            if elastic and ident in LEAVERS:
                out += ["--leave-at", str(args.leave_at)]
            return out

        for ident in range(FIRST):
            ranks.append(Rank(ident, [*common[:1], str(ident), *common[1:], *flags(ident)],
                              env | {"GRADSTAR_RANK": str(ident)},
                              (lambda r: grow.set() if "grow_now" in r else None)
                              if ident == 0 else None))
        deadline = time.time() + args.timeout
        if elastic:
            if not grow.wait(timeout=args.timeout):
                raise BenchmarkError("rank 0 never reached the step to grow at")
            joiner_env = {k: v for k, v in env.items() if k != "GRADSTAR_RANK"}
            for ident in JOINERS:
                ranks.append(Rank(ident, [*common[:1], str(ident), *common[1:],
                                          *flags(ident)], joiner_env | {"GRADSTAR_ELASTIC": "1"}))
        for rank in ranks:
            rank.wait(deadline)
    lines = [line for line in ranks[0].lines if "step" in line]
    steps = [line["t"] for line in lines]
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    finals = [r for r in ranks if r.first("accuracy") is not None]
    out = {"mode": mode, "elastic": elastic,
           "accuracy": statistics.mean(r.first("accuracy") for r in finals),
           "identical": len({r.first("params") for r in finals}) == 1,
           "finished": len(finals), "world": finals[0].first("world"),
           "pause_s": max(gaps) - statistics.median(gaps), "step_s": statistics.median(gaps),
           "cpu_per_step_s": (lines[-1]["cpu"] - lines[0]["cpu"]) / max(len(lines) - 1, 1),
           # rank 0's loss every 10 steps: where a run that ends badly went wrong
           "losses": [line["loss"] for line in ranks[0].lines if line.get("step", 1) % 10 == 0]}
    if elastic:
        joins = []
        for r in ranks[FIRST:]:
            first = next((line for line in r.lines if "step" in line), None)
            if first is None:
                raise BenchmarkError(f"newcomer {r.ident} left before its first step (it joined "
                                     f"after --leave-at?): {r.lines[-3:]}")
            joins.append({"join_s": first["t"] - r.spawned, "imported_s": r.first("imported"),
                          "joined_s": r.first("joined"), "built_s": r.first("built"),
                          "cpu_s": first.get("cpu"), "imported_cpu_s": r.first("cpu"),
                          # a replica's: its model made, and its join's own calls
                          "made_s": r.first("made"), "join_rpcs_s": r.first("join_rpcs_s"),
                          "milestones_cpu_s": r.milestones_cpu()})
        out["joins"] = joins
    return out


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """The job's options, shared with ``elastic_torchft.py``: runs, its length, when it grows
    and shrinks, each step's compute, the bound on a run and the JSON output."""
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--grow-at", type=int, default=40)
    parser.add_argument("--leave-at", type=int, default=250)
    parser.add_argument("--compute", type=float, default=0.03)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+",
                        default=["synchronous", "quorum", "streaming-diloco"],
                        choices=("synchronous", "quorum", "streaming-diloco"))
    add_job_options(parser)
    args = parser.parse_args()
    results = []
    for mode in args.modes:
        for _ in range(args.runs):
            for elastic in (True, False):
                results.append(run(mode, elastic, args))
                print(json.dumps(results[-1]), flush=True)
    rows = []
    for r in results:
        joins = r.get("joins", [])
        rows.append((r["mode"], "4->6->3" if r["elastic"] else "4 fixed",
                     " ".join(f"{j['join_s']:.1f}" for j in joins) or "-",
                     " ".join(f"{j['imported_s']:.1f}/{j['joined_s'] - j['imported_s']:.1f}/"
                              f"{j['built_s'] - j['joined_s']:.1f}" for j in joins) or "-",
                     " ".join(f"{j['cpu_s']:.1f} ({j['imported_cpu_s']:.1f})" for j in joins)
                     or "-",
                     f"{r['pause_s'] * 1000:.0f}", f"{r['step_s'] * 1000:.0f}",
                     f"{100 * r['accuracy']:.1f}", "yes" if r["identical"] else "NO"))
    print(format_table(("mode", "size", "join s", "import/init/DDP s",
                        "join CPU s (imports)", "pause ms",
                        "step ms", "accuracy %", "identical"), rows))
    print(f"load average: {loadavg()}")
    if args.json:
        write_json(args, "elastic", results=results, loadavg=loadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())

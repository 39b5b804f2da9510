"""Joining a running job: gradstar's newcomer beside torchft's healed replica, in the same run,
on the same job (the spirals MLP of ``_spirals_job``, Adam, 4 processes, 2 more started while
it trains).

What is measured
    Per configuration, 4 processes train; when the first reaches step ``--grow-at`` two more
    start, and the time from each newcomer's ``Popen`` to the end of its first step whose
    gradient the job took is its **join**, with the CPU seconds its process used until then
    (imports' share in brackets) and its milestones (imports / building the model and Adam /
    the framework's own set-up):

    * **torchft** (``_torchft_rank.py``, needs ``pip install -e '.[compare]'``): a lighthouse
      in this process (``min_replicas=2``), one replica group of one process each, torchft's
      ``Manager`` (gloo, asynchronous quorum), ``DistributedDataParallel`` and
      ``OptimizerWrapper``; a newcomer heals from a live replica (its first step after the
      heal is the first its gradients are part of);
    * **gradstar** Quorum and Synchronous (``elastic.py``'s job: ``GRADSTAR_ELASTIC=1``, the
      job grown on the hub's ledger / at a step boundary; it also shrinks later, which the
      joins do not see).

    The configurations alternate, ``--runs`` times, so that each sees the same load.

How to reproduce
    .venv/bin/pip install -e '.[compare]'        # torchft, once
    .venv/bin/python benchmarks/elastic_torchft.py --runs 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import BenchmarkError, format_table, loadavg, write_json
from _processes import kill_and_reap
from elastic import FIRST, JOINERS, Rank, add_job_options
from elastic import run as gradstar_run

TORCHFT_RANK = Path(__file__).resolve().parent / "_torchft_rank.py"


def torchft_run(args) -> dict:
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as exc:
        raise BenchmarkError("torchft is not installed: .venv/bin/pip install -e "
                             "'.[compare]'") from exc
    # join_timeout as torchft's own README starts its lighthouse with; the first quorum forms
    # as soon as every heartbeating replica asked for one
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10000)
    ranks: list[Rank] = []
    try:
        common = ["--lighthouse", lighthouse.address(), "--steps", str(args.steps),
                  "--compute", str(args.compute)]
        env = os.environ | {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        grow = threading.Event()
        ranks += [Rank(ident, [str(ident), *common,
                               *(["--grow-at", str(args.grow_at)] if ident == 0 else [])], env,
                       (lambda r: grow.set() if "grow_now" in r else None) if ident == 0
                       else None, script=TORCHFT_RANK)
                  for ident in range(FIRST)]
        deadline = time.time() + args.timeout
        if not grow.wait(timeout=args.timeout):
            raise BenchmarkError("replica 0 never reached the step to grow at")
        ranks += [Rank(ident, [str(ident), *common], env, script=TORCHFT_RANK)
                  for ident in JOINERS]
        # only the joins are measured: the job ends once each newcomer took part in a step
        # (torchft's replicas leaving at the end wait out quorum timeouts of their own)
        while not all(r.first("step") is not None for r in ranks[FIRST:]):
            if time.time() > deadline or any(r.proc.poll() is not None for r in ranks):
                raise BenchmarkError("a torchft replica ended or the newcomers did not take "
                                     "part in a step in time: " + "; ".join(
                                         f"{r.ident}: {r.lines[-2:]}" for r in ranks))
            time.sleep(0.1)
    finally:
        for rank in ranks:
            kill_and_reap(rank.proc)
        lighthouse.shutdown()
    joins = []
    for r in ranks[FIRST:]:
        first = next((line for line in r.lines if "step" in line), None)
        if first is None:
            raise BenchmarkError(f"torchft replica {r.ident} never took part in a step")
        joins.append({"join_s": first["t"] - r.spawned, "imported_s": r.first("imported"),
                      "made_s": r.first("made"), "joined_s": r.first("joined"),
                      "cpu_s": first["cpu"], "imported_cpu_s": r.first("cpu"),
                      "milestones_cpu_s": r.milestones_cpu()})
    steps = [line for line in ranks[0].lines if "step" in line]
    return {"framework": "torchft", "mode": "quorum per step", "joins": joins,
            "step_s": statistics.median(b["t"] - a["t"] for a, b in itertools.pairwise(steps)),
            "cpu_per_step_s": (steps[-1]["cpu"] - steps[0]["cpu"]) / max(len(steps) - 1, 1)}


def gradstar_joins(mode: str, args) -> dict:
    out = gradstar_run(mode, True, args)
    # a DDP rank builds its model after init_process_group, a replica before its join: the
    # columns below are imports / model and Adam / the framework's set-up for both
    joins = [{**j, "made_s": j["made_s"] if j["made_s"] is not None
              else j["imported_s"] + (j["built_s"] - j["joined_s"])} for j in out["joins"]]
    return {"framework": "gradstar", "mode": mode, "joins": joins, "step_s": out["step_s"],
            "cpu_per_step_s": out["cpu_per_step_s"], "accuracy": out["accuracy"],
            "identical": out["identical"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["quorum", "synchronous"],
                        choices=("quorum", "synchronous"))
    add_job_options(parser)
    args = parser.parse_args()
    results = []
    for _ in range(args.runs):
        results.append(torchft_run(args))
        print(json.dumps(results[-1]), flush=True)
        for mode in args.modes:
            results.append(gradstar_joins(mode, args))
            print(json.dumps(results[-1]), flush=True)
    rows = [(r["framework"], r["mode"], " ".join(f"{j['join_s']:.1f}" for j in r["joins"]),
             " ".join(f"{j['imported_s']:.1f}/{j['made_s'] - j['imported_s']:.1f}/"
                      f"{j['join_s'] - j['made_s']:.1f}" for j in r["joins"]),
             " ".join(f"{j['cpu_s']:.1f} ({j['imported_cpu_s']:.1f})" for j in r["joins"]),
             f"{r['step_s'] * 1000:.0f}", f"{r['cpu_per_step_s'] * 1000:.0f}")
            for r in results]
    print(format_table(("framework", "mode", "join s", "imports/model+Adam/rest s",
                        "join CPU s (imports)", "step ms",
                        "rank 0 CPU ms / step"), rows))
    print(f"load average: {loadavg()}")
    if args.json:
        write_json(args, "elastic_torchft", results=results, loadavg=loadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())

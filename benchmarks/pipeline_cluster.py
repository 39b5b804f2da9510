"""A Pipeline across hosts: GPipe and 1F1B with one stage per host of an emulated cluster, at
link speed and (``--rtt``) far apart. Needs root (network namespaces, tc).

The cluster (:mod:`emulated_cluster`): ``--stages`` hosts ``node0`` .. (one stage each), every
link ``--rate`` each way, and cluster.py's far-link options (``--rtt MS`` or ``HOST=MS ...``,
``--delay-line``, ``--host-sysctl``, ``--gradstar-env``:
:func:`_cluster_run.add_far_link_arguments`).
The coordinator (rendezvous only) runs on node0; activations and gradients cross the hosts on
the stages' own peer streams, stage s to s + 1 and back.

What is measured: ``benchmarks/pipeline.py``'s stage program (:func:`pipeline.pipeline_rank`):
both schedules in the same stage processes, step by step in alternating order, each on its own
copy of the stage from the same seed, ``--warmup`` untimed steps then ``--iters`` timed ones,
a barrier before each. ms/step: stage 0's median (the coordinator is on its host, so the
barrier lets it go first; its step runs from the first micro-batch's forward to the last
one's gradient back, the whole pipeline's critical path, where a far stage's own clock starts
half a round trip late); blocked: each stage's median time waiting for its neighbours
(``Pipeline.wait_seconds``). Both schedules train the same batches
from the same parameters: the largest difference of their final parameters is printed (float32
rounding only).

Round trips a schedule cannot avoid, with ``S`` stages ``R`` apart and ``M`` micro-batches and
no compute (write-up: docs/regions.md): a micro-batch's forward crosses S - 1 links one way and
its gradient S - 1 back, (S - 1) R in all. GPipe sends every forward at once: one such trip,
``(S - 1) R`` per step. 1F1B lets stage 0 hold S micro-batches (that is what bounds its
memory) and start the next only when one's gradient is back: ``ceil(M / S) (S - 1) R``. Link
bytes (one micro-batch's activation, float32, ``batch / M x width x 4`` per link each way)
beside them: ``M x that / rate``.

How to reproduce (as root)::

    .venv/bin/python benchmarks/pipeline_cluster.py --rate 200mbit --delay-line
    .venv/bin/python benchmarks/pipeline_cluster.py --rate 200mbit --rtt 100
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster_model import COORDINATOR_PORT, Layout, Placement
from _cluster_run import (
    Run,
    add_far_link_arguments,
    far_description,
    far_links,
    line_columns,
    on_emulated_cluster,
    print_failures,
    rank_env,
    sample,
    start_hub,
)
from _harness import BenchmarkError, MiB, format_table, loadavg, median
from emulated_cluster import CONGESTION_CONTROL, rate_bytes_per_second
from pipeline import SCHEDULES, pipeline_rank


def schedule_round_trips(schedule: str, stages: int, microbatches: int) -> int:
    """Round trips a step of ``schedule`` pays with nothing computed (module docstring)."""
    per_trip = stages - 1
    return per_trip if schedule == "gpipe" else math.ceil(microbatches / stages) * per_trip


def run_pipeline(run: Run, deadline: float) -> dict:
    """Both schedules' stages on the hosts; their results and the delay lines' counters."""
    args, layout = run.args, run.layout
    hub = start_hub(run, "pipeline", Placement(layout.nodes[0]), deadline)
    address = f"{run.cluster.address(layout.nodes[0])}:{COORDINATOR_PORT}"
    job = f"bench-pipe-{uuid.uuid4().hex[:8]}"
    ranks = []
    try:
        before = sample(run, hub)
        for rank, host in enumerate(layout.rank_hosts):
            spec = [rank, layout.world_size, address, job, args.width, args.layers_per_stage,
                    args.batch, args.microbatches, args.warmup, args.iters]
            ranks.append(run.start(host, f"stage{rank}", [
                sys.executable, "-u", __file__, "--rank-spec", json.dumps(spec)],
                rank_env(run, Placement(layout.nodes[0]), job)))
        results = [json.loads(r.wait_for('"result"', deadline))["result"] for r in ranks]
        after = sample(run, hub)
    except (BenchmarkError, OSError, ValueError) as error:
        raise BenchmarkError(f"pipeline: {error}\n" + "\n".join(r.tail() for r in ranks)) \
            from None
    finally:
        run.cluster.stop_processes([p.proc for p in ranks + hub])
    return {"stages": results, **line_columns(before, after)}


def report(row: dict, args) -> tuple[str, dict]:
    stages = row["stages"]
    rtt = args.rtt if isinstance(args.rtt, (int, float)) else 0.0
    hop_bytes = args.batch * args.width * 4  # one step's activations per link, one way
    link_ms = hop_bytes / rate_bytes_per_second(args.rate) * 1e3
    body, summary = [], {}
    for schedule in SCHEDULES:
        ms = median(stages[0][schedule]["times"]) * 1e3
        trips = schedule_round_trips(schedule, args.stages, args.microbatches)
        blocked = " / ".join(f"{median(s[schedule]['waits']) * 1e3:.0f}" for s in stages)
        body.append([schedule, f"{ms:.0f}", f"{args.batch / ms * 1e3:.0f}", blocked,
                     trips, f"{trips * rtt:.0f}", f"{link_ms:.0f}"])
        summary[schedule] = {"median_ms": ms, "round_trips": trips,
                             "times_ms": [t * 1e3 for t in stages[0][schedule]["times"]],
                             "median_wait_ms": [median(s[schedule]["waits"]) * 1e3
                                                for s in stages],
                             "peak_activation_bytes": [s[schedule]["peak_bytes"]
                                                       for s in stages]}
    diff = max(abs(a - b) for s in stages
               for a, b in zip(s["gpipe"]["sample"], s["1f1b"]["sample"], strict=True))
    summary["max_param_diff"] = diff
    text = format_table(["schedule", "ms/step", "samples/s",
                         "ms blocked on neighbours, stage 0 / 1 / ...", "round trips",
                         "their ms", "link ms"], body)
    line = "-" if row["line_cpu"] is None else f"{row['line_cpu']:.2f}"
    text += (f"\nmax |param(gpipe) - param(1f1b)| {diff:.1e}; busiest delay line {line} CPU; "
             f"activations {hop_bytes / MiB:.2f} MiB per link per step each way")
    return text, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=4, help="hosts, one stage each")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--rate", default="200mbit", help="each host link, both ways")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    add_far_link_arguments(parser)
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)  # a stage of this script
    args = parser.parse_args(argv)
    if args.rank_spec:
        print(json.dumps({"result": pipeline_rank(*json.loads(args.rank_spec))}), flush=True)
        return 0
    far_links(parser, args)
    rate_bytes_per_second(args.rate)
    if args.stages < 2:
        parser.error("--stages must be at least 2")
    layout = Layout(args.stages, 1)

    def each(run: Run) -> tuple[list[dict], list[tuple[str, str]]]:
        try:
            return [run_pipeline(run, time.monotonic() + args.timeout)], []
        except BenchmarkError as error:
            return [], [("pipeline", str(error))]

    rows, failures, logs = on_emulated_cluster("pipeline_cluster", layout.nodes, args, layout,
                                               CONGESTION_CONTROL, each)
    print(f"\nPipeline of {args.stages} stages (one a host) x {args.layers_per_stage} "
          f"Linear({args.width}) + ReLU, batch {args.batch} in {args.microbatches} "
          f"micro-batches, each link {args.rate} each way{far_description(args)}; "
          f"{args.warmup}+{args.iters} steps; load {loadavg()}\n")
    summary = {}
    if rows:
        text, summary = report(rows[0], args)
        print(text)
    print_failures(failures, logs)
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "pipeline_cluster", "args": vars(args) | {
            "json": str(args.json)}, "summary": summary, "failures": failures}, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

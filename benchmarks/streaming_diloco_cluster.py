"""DDP over gloo, DiLoCo and Streaming DiLoCo on an emulated cluster with slow (and far) links:
time to DDP's accuracy, or Streaming DiLoCo's compute utilisation. Needs root (network
namespaces, tc; cgroups for ``--host-cpu``).

    sudo python benchmarks/streaming_diloco_cluster.py [--rate 20mbit] [--workers 4]
        [--epochs 20] [--sync-every 150] [--fragments 4] [--delay 5] [--rtt 100]
        [--measure accuracy|utilisation] [--host-cpu 0.25]

One host per worker (``node0`` .. ``node{W-1}``) and one for the coordinator (``hub``), each link
shaped to ``--rate`` both ways, and with ``--rtt`` (or ``--delay-line``) a packet-level delay
line on every link: cluster.py's far-link options (:func:`_cluster_run.add_far_link_arguments`:
``--rtt MS`` or ``HOST=MS ...``, ``--host-sysctl``, ``--gradstar-env``). The workers run
:func:`streaming_diloco.worker` (same task, same model, same steps as
``benchmarks/streaming_diloco.py``).

``--measure accuracy`` (the default) runs gloo DDP, DiLoCo and Streaming DiLoCo: worker 0
saves its view of the global model every ``--snap-every`` steps with the time since it began
training, and the accuracy curve says when each method first reached the target: gloo DDP's
final test accuracy less one point. Link bytes are read from the bridge every 0.25 s: the peak
rate is the largest of any host link, either way, over one sample interval.

``--measure utilisation`` runs ``local`` (the same loop with nothing sent: each worker trains
alone), then ``--repeat`` times Streaming DiLoCo and ``local`` again (the machine is shared:
the local runs bracket each Streaming DiLoCo run), on the same hosts, each run a job of its
own. A worker's steps/s is its inner steps over its training loop's own clock (from its 5th
step: the join, torch's first passes and the final merges excluded); utilisation is a
Streaming DiLoCo run's slowest worker's steps/s over the mean of the slowest of the local runs
beside it. "in step()" is the share of the loop the training thread spent inside
``sdl.step()`` (starting rounds, waiting for and merging the ones due; the most of any
worker), "CPU ms/step" a worker's CPU over the loop (every thread: the rounds' own work
included) per step, the mean of the workers: on a shared machine the steps/s of two runs
differ by what else ran, these two much less. ``--host-cpu C`` gives every worker host C of
one core (a cgroup each, as ``benchmarks/sync_modes.py``), so that a host's compute depends
less on what the others run; the hub is not limited.

The link-bound ideal beside it: a round of one fragment (U bytes up per replica: float32, or
its wire format's; D down, the float32 global fragment) ends when the last replica's U reached
the hub and the W global fragments left its link, and pays one round trip (the contribution's
way in, the global fragment's way out): ``round >= (U + W D) / rate + RTT``. Its merge waits
``tau`` inner steps, so with a local step of ``t`` s a round stalls at least
``max(0, round - tau t)``, once per ``H / P`` steps: ideal utilisation
``(H/P) t / ((H/P) t + stall)``. ``--sync-every 1 --fragments 1 --delay 0`` with a small model
times the round itself: a step is then one round.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster_model import Layout, Placement
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
from _harness import BenchmarkError, format_table, loadavg
from _host_cpu import HostCpu
from emulated_cluster import CONGESTION_CONTROL, rate_bytes_per_second
from streaming_diloco import arguments, make_model

SAMPLE_SECONDS = 0.25
MEASURES = ("accuracy", "utilisation")


def methods(args) -> list[str]:
    """The runs, in order: accuracy's three methods, or utilisation's local runs around each
    Streaming DiLoCo run (``--repeat`` of them)."""
    if args.measure == "accuracy":
        return ["gloo", "diloco", "streaming"]
    return ["local", *(["streaming", "local"] * args.repeat)]


def run_method(run: Run, method: str, label: str, tmp: Path, cpu: HostCpu | None) -> dict:
    """One method's run on the workers' hosts (a fresh job on the running coordinator): its
    workers' results, the link bytes and peak rate, worker 0's snapshots."""
    args, workers = run.args, run.layout.nodes
    snaps = tmp / label
    snaps.mkdir()
    env = rank_env(run, Placement("hub"), f"bench-{label}") | {
        "GRADSTAR_SHARED_MEMORY": "0", "BENCH_SNAP_EVERY": str(args.snap_every),
        "BENCH_JOB": f"bench-{label}",  # each run its own rounds on the one coordinator
        "BENCH_GLOO_INIT": f"tcp://{run.cluster.address(workers[0])}:29500",
        "GLOO_SOCKET_IFNAME": "eth0"}
    if args.measure == "accuracy":  # worker 0's snapshots (not in a loop timed for its pace)
        env["BENCH_SNAPSHOTS"] = str(snaps)
    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in (
        "workers", "epochs", "samples", "batch_size", "hidden", "lr", "sync_every",
        "fragments", "delay")] + ([f"--wire={args.wire}"] if args.wire else [])
    outs = [tmp / f"{label}-{i}.json" for i in range(len(workers))]
    deadline = time.monotonic() + args.timeout
    procs = []
    try:
        first = sample(run, [])
        for i, (host, out) in enumerate(zip(workers, outs, strict=True)):
            procs.append(run.start(host, f"{label}-w{i}", [
                sys.executable, "benchmarks/streaming_diloco.py", "--worker", method, str(i),
                str(out), *forwarded], env))
            if cpu is not None:
                cpu.add(host, procs[-1].proc.pid)  # ip netns exec execs: the worker's pid
        peak, last = 0.0, first
        while any(p.proc.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise BenchmarkError(f"{label}: not done within {args.timeout:g} s")
            time.sleep(SAMPLE_SECONDS)
            now = sample(run, [])
            for name, link in now.links.items():
                delta = link - last.links[name]
                peak = max(peak, max(delta.rx, delta.tx) / (now.at - last.at))
            last = now
        if any(p.proc.returncode for p in procs):
            raise BenchmarkError(f"a {method} worker failed")
    except BenchmarkError as error:
        raise BenchmarkError(f"{label}: {error}\n" + "\n".join(p.tail() for p in procs)) \
            from None
    finally:
        run.cluster.stop_processes([p.proc for p in procs])
    moved = sum((last.links[n] - first.links[n]).rx + (last.links[n] - first.links[n]).tx
                for n in workers)
    return {"method": method, "label": label, "snapshots": str(snaps), "link_bytes": moved,
            "peak_rate": peak, "workers": [json.loads(o.read_text()) for o in outs],
            **line_columns(first, last)}


def curve(row: dict, args) -> list[tuple[float, float]]:
    """(seconds since worker 0 began training, test accuracy) of each snapshot."""
    from gradstar.worker.demo.spirals import evaluate, load_flat_parameters, make_spirals

    data = make_spirals(args.samples, seed=0)
    model = make_model(data.features, data.classes, args.hidden)
    points = []
    for path in sorted(Path(row["snapshots"]).glob("*.npy")):
        seconds = float(path.stem.rsplit("-", 1)[1])
        load_flat_parameters(model, np.load(path))
        points.append((seconds, evaluate(model, data.test)[1]))
    return sorted(points)


def accuracy_report(rows: list[dict]) -> str:
    target = rows[0]["curve"][-1][1] - 0.01
    gloo_time = next(t for t, acc in rows[0]["curve"] if acc >= target)
    body = []
    for r in rows:
        reached = next((t for t, acc in r["curve"] if acc >= target), None)
        body.append([r["method"], f"{r['curve'][-1][1]:.3f}",
                     "never" if reached is None else f"{reached:.1f} s",
                     f"{gloo_time / reached:.1f}x" if reached else "",
                     f"{r['link_bytes']:,}", f"{r['peak_rate']:,.0f}"])
    return (f"target = gloo DDP's final accuracy - 1 point = {target:.3f}\n" + format_table(
        ["method", "final acc", "time to target", "vs gloo", "worker link bytes",
         "peak link B/s"], body))


def fragment_bytes(args) -> list[tuple[int, int]]:
    """Per fragment, what one replica uploads per round (float32, or its wire format) and
    downloads (the global fragment, float32)."""
    from gradstar.client.outer.plan import split_fragments
    from gradstar.wire.formats import wire_format
    from gradstar.worker.demo.spirals import make_spirals

    data = make_spirals(args.samples, seed=0)
    sizes = [p.numel() for p in make_model(data.features, data.classes,
                                           args.hidden).parameters()]
    numels = [sum(sizes[i] for i in run) for run in split_fragments(sizes, args.fragments)]
    encoded = wire_format(args.wire) if args.wire else None
    return [(encoded.encoded_nbytes(n) if encoded else 4 * n, 4 * n) for n in numels]


def utilisation_report(rows: list[dict], args) -> tuple[str, dict]:
    """Each Streaming DiLoCo run's steps/s over the mean of the local runs beside it."""
    def rate(row: dict) -> float:  # the slowest worker sets the job's pace
        return min(w["timed_steps"] / w["loop_s"] for w in row["workers"])

    def in_step(row: dict) -> float:
        return max(w["in_step_s"] / w["loop_s"] for w in row["workers"])

    def cpu_ms(row: dict) -> float:  # every thread of a worker, per timed step (mean)
        return statistics.mean(w["loop_cpu_s"] / w["timed_steps"] for w in row["workers"]) * 1e3

    local = [rate(r) for r in rows if r["method"] == "local"]
    step_s = 1.0 / statistics.mean(local)
    rtt_ms = args.rtt if isinstance(args.rtt, (int, float)) else 0.0
    if isinstance(args.rtt, dict):  # hub to a worker: the farthest pair through the core
        rtt_ms = args.rtt.get("hub", 0.0) + max(args.rtt.get(w, 0.0) for w in
                                               (f"node{i}" for i in range(args.workers)))
    up, down = max(fragment_bytes(args), key=lambda f: f[1])
    round_s = (up + args.workers * down) / rate_bytes_per_second(args.rate) + rtt_ms / 1e3
    every = args.sync_every / args.fragments * step_s
    ideal = every / (every + max(0.0, round_s - args.delay * step_s))
    body, ratios = [], []
    for i, r in enumerate(rows):
        ratio = "-"
        if r["method"] == "streaming":
            beside = [rate(n) for n in rows[max(0, i - 1):i + 2] if n["method"] == "local"]
            ratios.append(rate(r) / statistics.mean(beside))
            ratio = f"{ratios[-1]:.1%}"
        body.append([r["label"], f"{rate(r):.1f}", ratio,
                     f"{in_step(r):.1%}" if r["method"] == "streaming" else "-",
                     f"{cpu_ms(r):.1f}",
                     f"{max(w['loop_s'] for w in r['workers']):.1f}",
                     "-" if r["line_cpu"] is None else f"{r['line_cpu']:.2f}"])
    figures = {"local_steps_per_s": local, "utilisation": ratios,
               "cpu_ms_per_step": {r["label"]: cpu_ms(r) for r in rows},
               "in_step": [in_step(r) for r in rows if r["method"] == "streaming"],
               "ideal_utilisation": ideal, "round_ideal_s": round_s,
               "overlap_s": args.delay * step_s, "largest_fragment_bytes": [up, down]}
    text = format_table(["run", "steps/s (slowest worker)", "of the local runs beside",
                         "in step() (most)", "CPU ms/step", "loop s", "line CPU"], body)
    text += (f"\nutilisation {' '.join(f'{u:.1%}' for u in ratios)}; ideal {ideal:.1%}: a "
             f"round of the largest fragment ({up:,} B up, {down:,} B down per replica) takes "
             f"at least {round_s * 1e3:.0f} ms ((up + {args.workers} x down) / rate + 1 RTT) "
             f"against tau x step = {args.delay} x {step_s * 1e3:.1f} ms")
    return text, figures


def main() -> int:
    parser = arguments()
    parser.add_argument("--rate", default="20mbit", help="each host link, both ways")
    parser.add_argument("--snap-every", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=1,
                        help="utilisation: Streaming DiLoCo runs, each between two local ones")
    parser.add_argument("--measure", choices=MEASURES, default="accuracy",
                        help="accuracy: time to gloo DDP's accuracy (gloo, DiLoCo, Streaming "
                             "DiLoCo); utilisation: Streaming DiLoCo's steps/s against the same "
                             "loop without communication")
    parser.add_argument("--host-cpu", type=float,
                        help="cores each worker host may use (a cgroup each; default: no limit)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    add_far_link_arguments(parser)
    args = parser.parse_args()
    far_links(parser, args)
    rate_bytes_per_second(args.rate)
    layout = Layout(args.workers, 1)

    def each(run: Run) -> tuple[list[dict], list[tuple[str, str]]]:
        rows, failures, cpu = [], [], None
        try:
            if args.host_cpu is not None:
                cpu = HostCpu(layout.nodes, args.host_cpu)
            hub = start_hub(run, "hub", Placement("hub"), time.monotonic() + 60)
            with tempfile.TemporaryDirectory() as tmp:
                for i, method in enumerate(methods(args)):
                    label = f"{method}-{i}"
                    try:
                        rows.append(run_method(run, method, label, Path(tmp), cpu))
                    except BenchmarkError as error:
                        failures.append((label, str(error)))
                        print(f"  {label} FAILED", file=sys.stderr, flush=True)
                        continue
                    if args.measure == "accuracy":  # the snapshots go with tmp
                        rows[-1]["curve"] = curve(rows[-1], args)
                    print(f"  {label} done", file=sys.stderr, flush=True)
            run.cluster.stop_processes([p.proc for p in hub])
        except BenchmarkError as error:
            failures.append(("hub", str(error)))
        finally:
            if cpu is not None:
                cpu.remove()
        return rows, failures

    rows, failures, logs = on_emulated_cluster(
        "streaming_diloco_cluster", [*layout.nodes, "hub"], args, layout, CONGESTION_CONTROL,
        each)
    cores = f", {args.host_cpu:g} core per worker host" if args.host_cpu else ""
    print(f"\n{args.workers} workers + hub on links of {args.rate} each way"
          f"{far_description(args)}{cores}; hidden {args.hidden}, batch {args.batch_size}, "
          f"H={args.sync_every}, P={args.fragments}, tau={args.delay}"
          f"{', wire ' + args.wire if args.wire else ''}; load {loadavg()}")
    figures = {}
    if args.measure == "accuracy" and rows and rows[0]["method"] == "gloo":
        print(accuracy_report(rows))
    elif args.measure == "utilisation" and any(r["method"] == "local" for r in rows) and any(
            r["method"] == "streaming" for r in rows):
        text, figures = utilisation_report(rows, args)
        print(text)
    print_failures(failures, logs)
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "streaming_diloco_cluster", "args": vars(args) | {
                "json": str(args.json)}, "figures": figures,
            "rows": [{k: v for k, v in r.items() if k != "workers"} | {"workers": [
                {k: v for k, v in w.items() if k != "params"} for w in r["workers"]]}
                for r in rows], "failures": failures}, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

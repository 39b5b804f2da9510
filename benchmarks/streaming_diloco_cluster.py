"""DDP over gloo, DiLoCo and Streaming DiLoCo on an emulated cluster with slow links: time to
DDP's accuracy, bytes and peak rate per host link. Needs root (network namespaces, tc).

    sudo python benchmarks/streaming_diloco_cluster.py [--rate 20mbit] [--workers 4]
        [--epochs 20] [--sync-every 150] [--fragments 4] [--delay 5]

One host per worker and one for the coordinator (``hub``), each link shaped to ``--rate`` both
ways (:mod:`emulated_cluster`). The workers run :func:`streaming_diloco.worker` (same task,
same model, same steps as ``benchmarks/streaming_diloco.py``); worker 0 saves its view of the
global model every ``--snap-every`` steps with the time since it began training, and the
accuracy curve says when each method first reached the target: gloo DDP's final test accuracy
less one point. Link bytes are read from the bridge every 0.25 s: the peak rate is the largest
of any host link, either way, over one sample interval.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from emulated_cluster import EmulatedCluster
from streaming_diloco import arguments, make_model

PORT = 29400
GLOO_PORT = 29500
TOKEN = "bench-streaming-diloco-token"
SAMPLE_SECONDS = 0.25


def run_method(cluster: EmulatedCluster, method: str, args, tmp: Path) -> dict:
    hub = f"{cluster.address('hub')}:{PORT}"
    snaps = tmp / method
    snaps.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    env.update(GRADSTAR_COORDINATOR=hub, GRADSTAR_TOKEN=TOKEN, GRADSTAR_SHARED_MEMORY="0",
               BENCH_SNAPSHOTS=str(snaps), BENCH_SNAP_EVERY=str(args.snap_every),
               BENCH_GLOO_INIT=f"tcp://{cluster.address('w0')}:{GLOO_PORT}",
               GLOO_SOCKET_IFNAME="eth0")
    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in (
        "workers", "epochs", "samples", "batch_size", "hidden", "lr", "sync_every",
        "fragments", "delay")]
    outs = [tmp / f"{method}-{i}.json" for i in range(args.workers)]
    before = cluster.link_bytes()
    procs = [cluster.popen(f"w{i}", [sys.executable, "benchmarks/streaming_diloco.py",
                                     "--worker", method, str(i), str(out), *forwarded], env=env)
             for i, out in enumerate(outs)]
    peak, last, last_at = 0.0, before, time.monotonic()
    while any(p.poll() is None for p in procs):
        time.sleep(SAMPLE_SECONDS)
        now, links = time.monotonic(), cluster.link_bytes()
        for name, link in links.items():
            delta = link - last[name]
            peak = max(peak, max(delta.rx, delta.tx) / (now - last_at))
        last, last_at = links, now
    if any(p.returncode for p in procs):
        raise SystemExit(f"a {method} worker failed")
    moved = sum((last[n] - before[n]).rx + (last[n] - before[n]).tx for n in last if n != "hub")
    return {"method": method, "snapshots": snaps, "link_bytes": moved, "peak_rate": peak}


def curve(method_row: dict, args) -> list[tuple[float, float]]:
    """(seconds since worker 0 began training, test accuracy) of each snapshot."""
    from gradstar.worker.demo.spirals import evaluate, load_flat_parameters, make_spirals

    data = make_spirals(args.samples, seed=0)
    model = make_model(data.features, data.classes, args.hidden)
    points = []
    for path in sorted(method_row["snapshots"].glob("*.npy")):
        seconds = float(path.stem.rsplit("-", 1)[1])
        load_flat_parameters(model, np.load(path))
        points.append((seconds, evaluate(model, data.test)[1]))
    return sorted(points)


def main() -> None:
    parser = arguments()
    parser.add_argument("--rate", default="20mbit", help="each host link, both ways")
    parser.add_argument("--snap-every", type=int, default=25)
    args = parser.parse_args()
    names = ["hub", *(f"w{i}" for i in range(args.workers))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(names, rate=args.rate) as cluster:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
        env.update(GRADSTAR_TOKEN=TOKEN, GRADSTAR_SHARED_MEMORY="0")
        coordinator = cluster.popen("hub", [
            sys.executable, "-m", "gradstar", "coordinator", "--host", "0.0.0.0", "--port",
            str(PORT), "--log-level", "WARNING"], env=env, stdout=subprocess.DEVNULL)
        time.sleep(3)
        try:
            for method in ("gloo", "diloco", "streaming"):
                rows.append(run_method(cluster, method, args, Path(tmp)))
                rows[-1]["curve"] = curve(rows[-1], args)
                print(rows[-1]["method"], rows[-1]["curve"][-1], flush=True)
        finally:
            cluster.stop_processes([coordinator])
    target = rows[0]["curve"][-1][1] - 0.01
    gloo_time = next(t for t, acc in rows[0]["curve"] if acc >= target)
    print(f"\n{args.workers} workers + hub on links of {args.rate} each way; H={args.sync_every}, "
          f"P={args.fragments}, tau={args.delay}; target = gloo DDP's final accuracy - 1 point "
          f"= {target:.3f}")
    print(f"{'method':<10} {'final acc':>9} {'time to target':>15} {'vs gloo':>8} "
          f"{'worker link bytes':>18} {'peak link B/s':>14}")
    for r in rows:
        reached = next((t for t, acc in r["curve"] if acc >= target), None)
        when = f"{reached:.1f} s" if reached is not None else "never"
        ratio = f"{gloo_time / reached:.1f}x" if reached else ""
        print(f"{r['method']:<10} {r['curve'][-1][1]:>9.3f} {when:>15} {ratio:>8} "
              f"{r['link_bytes']:>18,} {r['peak_rate']:>14,.0f}")


if __name__ == "__main__":
    main()

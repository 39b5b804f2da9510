"""Bytes and accuracy: DDP, DiLoCo and Streaming DiLoCo on the same task, the same replicas.

    python benchmarks/streaming_diloco.py [--workers 4] [--epochs 20] [--sync-every 100]
        [--fragments 4] [--delay 5]

Every method trains the same MLP (spirals features, 4 hidden-to-hidden layers of ``--hidden``,
so 4 fragments of whole layers are about equal) with SGD and momentum, each worker on its own slice
of the training set, the same number of inner steps, through one embedded coordinator:

- ``ddp``: ``gradstar.DDP`` over a process group, gradients averaged every step;
- ``diloco``: ``gradstar.StreamingDiLoCo`` with one fragment, no overlap and ``alpha=0`` (plain
  DiLoCo: the whole model's pseudo-gradient every H steps, outer Nesterov on the hub);
- ``streaming``: ``StreamingDiLoCo`` with ``--fragments`` P, ``--delay`` tau, ``alpha=0.5``;
- ``streaming-kill`` (ask for it with ``--methods``): the same, with one worker SIGKILLed half
  way through and started again at once, as the worker agent does (rounds close without it
  after 5 s, with ``min_replicas`` one less than all): its accuracy against ``streaming``'s.

Reported per method: the global model's test accuracy, payload bytes through the hub (all
workers, both ways), and the peak *upload* of one worker in one inner step (what a sync
interval must push through a host's link: the whole model for DDP at every step and for DiLoCo
at its sync steps, one fragment for Streaming DiLoCo). DDP's bytes are the hub's own counters;
the replicas' are their clients' counters. Timing is wall clock on this machine, for orientation
only (no link emulation here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gradstar.wire.formats import FORMATS

METHODS = ("ddp", "diloco", "streaming", "streaming-kill")
#: Also for the emulated cluster (streaming_diloco_cluster.py): torch's DDP over gloo, and
#: ``local``, the same loop with nothing sent (the compute a replica would do alone).
WORKER_METHODS = (*METHODS, "gloo", "local")
#: Steps before a worker's loop clock starts (its ``loop_s`` covers the rest).
WARM_STEPS = 5


def make_model(features: int, classes: int, hidden: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Linear(features, hidden), nn.SiLU()]
    for _ in range(4):
        layers += [nn.Linear(hidden, hidden), nn.SiLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, classes))


def worker(method: str, index: int, out: Path, args: argparse.Namespace) -> None:
    import torch

    import gradstar
    from gradstar.worker.demo.modes import MomentumSGD
    from gradstar.worker.demo.spirals import make_spirals

    torch.set_num_threads(1)  # workers share the host's cores
    data = make_spirals(args.samples, seed=0)
    x = torch.from_numpy(data.train.x[index::args.workers])
    y = torch.from_numpy(data.train.y[index::args.workers])
    model = make_model(data.features, data.classes, args.hidden)
    steps = args.epochs * (len(y) // args.batch_size)
    upload = 0
    sizes = None
    if method == "ddp":
        pg = gradstar.init_process_group(job="bench-ddp", world_size=args.workers, rank=index)
        trained = gradstar.DDP(model, pg)
    elif method == "local":
        trained = model
    elif method == "gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=os.environ["BENCH_GLOO_INIT"],
                                world_size=args.workers, rank=index)
        trained = torch.nn.parallel.DistributedDataParallel(model)
    else:
        streaming = method.startswith("streaming")
        # streaming-kill: one worker is killed and restarted mid-run; the rounds close with
        # the others (one fewer than all) after round_timeout.
        killing = method == "streaming-kill"
        sdl = gradstar.StreamingDiLoCo(
            model, sync_every=args.sync_every, fragments=args.fragments if streaming else 1,
            delay=args.delay if streaming else 0, alpha=0.5 if streaming else 0.0,
            outer_lr=0.7, outer_momentum=0.9, min_replicas=args.workers - killing,
            job=os.environ.get("BENCH_JOB", f"bench-{method}"), replica=f"w{index}",
            round_timeout=5.0 if killing else 60.0,
            wire=args.wire)
        trained = model
        # What a round uploads per fragment: float32, or the bytes its wire format encodes.
        sizes = [sdl.wire.encoded_nbytes(n) if sdl.wire is not None else 4 * n
                 for n in (sum(p.numel() for p in group) for group in sdl.groups)]
    snapshots = os.environ.get("BENCH_SNAPSHOTS") if index == 0 else None
    snap_every = int(os.environ.get("BENCH_SNAP_EVERY", "25"))
    began = time.time()

    def snapshot(step: int) -> None:
        """Worker 0's view of the global model, with the time: the curve to an accuracy."""
        if sizes is None:
            flat = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
        else:
            flat = sdl.global_parameters
        np.save(Path(snapshots) / f"{method}-{step:06d}-{time.time() - began:.3f}.npy", flat)

    opt = MomentumSGD(model.parameters(), args.lr, 0.9)
    # The training loop's own clock from its WARM_STEPS-th step (torch's first passes are
    # slow; join and finish excluded), and the part of it the training thread spent inside
    # sdl.step(): starting and merging rounds.
    first = 0 if sizes is None else sdl.local_steps
    loop_began, in_step = None, 0.0
    # A restarted replica takes up the schedule where the hub's latest round began.
    for step in range(first, steps):
        if step == first + WARM_STEPS:
            loop_began, in_step, cpu_began = time.perf_counter(), 0.0, time.process_time()
        start = (step % (len(y) // args.batch_size)) * args.batch_size
        opt.zero_grad()
        torch.nn.functional.cross_entropy(trained(x[start:start + args.batch_size]),
                                          y[start:start + args.batch_size]).backward()
        opt.step()
        if sizes is not None:
            t = time.perf_counter()
            upload = max(upload, sum(sizes[p] for p in sdl.step()))
            in_step += time.perf_counter() - t
        if snapshots and (step + 1) % snap_every == 0:
            snapshot(step + 1)
    loop_seconds = time.perf_counter() - loop_began if loop_began is not None else 0.0
    loop_cpu = time.process_time() - cpu_began if loop_began is not None else 0.0
    if method == "local":
        final = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
        moved = 0
    elif sizes is None:
        final = np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()])
        moved, upload = 0, 4 * final.shape[0]
        if method == "ddp":
            pg.close()
        else:
            torch.distributed.destroy_process_group()
    else:
        sdl.finish()
        final, moved = sdl.global_parameters, sdl.bytes_exchanged
        sdl.close()
    out.write_text(json.dumps({"steps": steps, "bytes": moved, "peak_upload": upload,
                               "timed_steps": max(0, steps - first - WARM_STEPS),
                               "loop_s": loop_seconds, "in_step_s": in_step,
                               "loop_cpu_s": loop_cpu, "params": final.tolist()}))


def kill_and_restart(procs: list, start, hub, args: argparse.Namespace) -> None:
    """SIGKILL the last worker once fragment 0 is half way through its rounds, and start it
    again at once (as the worker agent does)."""
    steps = args.epochs * ((args.samples * 4 // 5) // args.workers // args.batch_size)
    half = steps // args.sync_every // 2
    table = hub.coordinator.rounds
    while True:
        held = table.global_model("bench-streaming-kill", "global", 0)
        if held is not None and held.rounds >= half:
            break
        time.sleep(0.05)
    procs[-1].kill()
    procs[-1].wait()
    print(f"killed worker {len(procs) - 1} after round {held.rounds} of fragment 0; "
          "restarting it", flush=True)
    procs[-1] = start(len(procs) - 1)


def run_method(method: str, args: argparse.Namespace, hub, tmp: Path) -> dict:
    from gradstar.worker.demo.spirals import evaluate, load_flat_parameters, make_spirals

    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
    env.update(GRADSTAR_COORDINATOR=hub.address, GRADSTAR_SHARED_MEMORY="0")
    outs = [tmp / f"{method}-{i}.json" for i in range(args.workers)]
    began = time.monotonic()
    def start(i: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--worker", method, str(i),
                                 str(outs[i]), *sys.argv[1:]], env=env)

    procs = [start(i) for i in range(args.workers)]
    if method == "streaming-kill":
        kill_and_restart(procs, start, hub, args)
    if any(p.wait() for p in procs):
        raise SystemExit(f"a {method} worker failed")
    seconds = time.monotonic() - began
    results = [json.loads(o.read_text()) for o in outs]
    moved = sum(r["bytes"] for r in results)
    if method == "ddp":
        counters = hub.coordinator.rendezvous.jobs["bench-ddp"].counters
        moved = counters.bytes_in + counters.bytes_out
    data = make_spirals(args.samples, seed=0)
    model = make_model(data.features, data.classes, args.hidden)
    load_flat_parameters(model, np.asarray(results[0]["params"], dtype=np.float32))
    _, accuracy, _ = evaluate(model, data.test)
    return {"method": method, "accuracy": accuracy, "bytes": moved, "seconds": seconds,
            "peak_upload": max(r["peak_upload"] for r in results), "steps": results[0]["steps"]}


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=24_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--sync-every", type=int, default=100, help="H")
    parser.add_argument("--fragments", type=int, default=4, help="P (streaming)")
    parser.add_argument("--delay", type=int, default=5, help="tau (streaming)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS[:3]))
    parser.add_argument("--wire", choices=list(FORMATS),
                        help="DiLoCo and Streaming DiLoCo send their pseudo-gradients in this "
                             "format (default raw float32)")
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "INDEX", "OUT"),
                        help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = arguments().parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), Path(args.worker[2]), args)
        return
    from gradstar.config import CoordinatorSettings
    from gradstar.coordinator import EmbeddedCoordinator

    settings = CoordinatorSettings(host="127.0.0.1", port=0, token=None, admin_token=None,
                                   state_dir=None, metrics_port=None, shared_memory=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedCoordinator(settings) as hub:
        for method in args.methods:
            rows.append(run_method(method, args, hub, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    ddp = next((r for r in rows if r["method"] == "ddp"), None)
    print(f"\n{args.workers} workers, {rows[0]['steps']} inner steps each, H={args.sync_every}, "
          f"P={args.fragments}, tau={args.delay}")
    print(f"{'method':<10} {'test acc':>8} {'bytes':>14} {'vs DDP':>8} {'peak upload/step':>17}"
          f" {'seconds':>8}")
    for r in rows:
        ratio = f"{ddp['bytes'] / r['bytes']:.0f}x less" if ddp and r is not ddp else ""
        print(f"{r['method']:<10} {r['accuracy']:>8.3f} {r['bytes']:>14,} {ratio:>8} "
              f"{r['peak_upload']:>17,} {r['seconds']:>8.1f}")


if __name__ == "__main__":
    main()

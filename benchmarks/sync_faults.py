"""Sync modes under faults: random ranks SIGKILLed during one run, each restarted by the agent
(issue 32's faults target). One host, real processes, nothing emulated.

The run
    A coordinator (``gradstar coordinator``, loopback, ``--heartbeat-timeout`` 5 s) and one
    agent (``gradstar worker --nproc W --world-size W --max-restarts K+5``) whose ranks run this
    file's rank program with ``GRADSTAR_ELASTIC=1``: the demo's spirals MLP (hidden 128, rank r
    trains on every W-th training sample from r, ``--batch`` rows an iteration, SGD lr 0.05 with
    momentum 0.9) in ``gradstar.DDP(sync_mode=Quorum(min_ranks=W-1, timeout=0.5))`` until the
    hub's step count reaches ``--steps``; then ``ddp.synchronize()``, and each rank writes its
    parameters. Each rank appends JSON lines to a file of its own: ``start`` (pid, restart
    count, the process's start time read from ``/proc/self/stat``), ``joined`` (elastic
    replacement or not, the step it starts at), ``contributed`` (its first gradient the hub
    accepted in this life), ``error`` (an exception, with its text), ``final`` (step count and
    the SHA-256 of its parameters).

The faults
    Every ``--kill-every`` seconds the driver SIGKILLs a random rank among those whose current
    life has contributed (so every kill hits a rank that was training), ``--kills`` times, and
    stops killing once the hub is past ``--quiet-from`` of the steps (the end runs clean: a rank
    restarted after every other one finished would find no generation to join). The
    agent restarts each; the new process takes the lost rank's place (an elastic join), loads
    the hub's snapshot and replays the aggregates after it.

What is printed (nothing asserted; ``--json`` saves it)
    For the faulted run and an undisturbed run of the same steps (``--kills 0``, the reference):
    wall seconds, kills done, restarts the agent made, errors raised by ranks (must be 0: no
    surviving rank raises), per restart the seconds from its process's start to its first
    accepted contribution (max must be <= 10 s), whether every rank ends bitwise identical,
    and the final test accuracy (within 1 point of the undisturbed run).

Run: ``.venv/bin/python benchmarks/sync_faults.py --kills 20`` (about 2-4 minutes).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import format_table, loadavg

HIDDEN, LR, MOMENTUM, SAMPLES = 128, 0.05, 0.9, 24_000


# -- the rank program ---------------------------------------------------------------------------


def process_start_time() -> float:
    """Wall-clock time this process started (``/proc/self/stat``'s start time), so a restart's
    time to contribute includes the interpreter's and the imports' start-up."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + start_ticks / ticks


def rank_main(spec: dict) -> int:
    started = process_start_time()
    import numpy as np
    import torch

    import gradstar
    from gradstar.worker.demo import spirals as task

    torch.set_num_threads(1)
    rank = int(os.environ["GRADSTAR_RANK"])
    restart = int(os.environ.get("GRADSTAR_RESTART_COUNT", "0"))
    log = open(Path(spec["out"]) / f"rank{rank}.jsonl", "a")

    def emit(event: str, **fields) -> None:
        log.write(json.dumps({"event": event, "rank": rank, "pid": os.getpid(),
                              "restart": restart, "t": time.time(), **fields}) + "\n")
        log.flush()

    emit("start", started=started)
    try:
        n = spec["world_size"]
        data = task.make_spirals(SAMPLES, seed=0)
        x = torch.from_numpy(data.train.x[rank::n])
        y = torch.from_numpy(data.train.y[rank::n])
        model = task.make_model(data.features, data.classes, HIDDEN)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        pg = gradstar.init_process_group(timeout=120, join_timeout=120)
        emit("group", replacement=pg.replacement)
        ddp = gradstar.DDP(model, pg, optimizer=opt,
                           sync_mode=gradstar.Quorum(min_ranks=n - 1, timeout=0.5))
        stats = ddp.sync_stats()
        emit("joined", replacement=pg.replacement, step=stats.step)
        batch, batches = spec["batch"], len(y) // spec["batch"]
        contributed, i = False, 0
        while stats.step < spec["steps"]:
            start = ((i + stats.step) % batches) * batch
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x[start:start + batch]),
                                                     y[start:start + batch])
            loss.backward()
            if not contributed and stats.recent_contributions[-1].step is not None:
                contributed = True
                emit("contributed", step=stats.recent_contributions[-1].step)
            opt.step()
            i += 1
            if i % 50 == 0:  # the driver's view of the run's progress
                emit("progress", step=stats.step)
        ddp.synchronize()
        flat = task.flat_parameters(model)
        np.save(Path(spec["out"]) / f"final{rank}.npy", flat)
        emit("final", step=stats.step, sha=hashlib.sha256(flat.tobytes()).hexdigest(),
             dropped=stats.dropped, contributions=stats.contributions)
        pg.close()
    except BaseException as error:
        emit("error", error=f"{type(error).__name__}: {error}")
        raise
    return 0


# -- the driver ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_events(out: Path, world: int) -> dict[int, list[dict]]:
    events = {}
    for rank in range(world):
        path = out / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        # A line being written when read is skipped; the next read gets it whole.
        events[rank] = [json.loads(line) for line in lines if line.endswith("}")]
    return events


def current_life(events: list[dict]) -> list[dict]:
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    return events[starts[-1]:] if starts else []


def hub_step(events: dict[int, list[dict]]) -> int:
    return max((e.get("step") or 0 for es in events.values() for e in es
                if e["event"] in ("contributed", "joined", "progress")), default=0)


def run(args, kills: int, out: Path) -> dict:
    """One run: coordinator, agent, the kills; what it measured."""
    out.mkdir(parents=True)
    port = free_port()
    py = sys.executable
    hub = subprocess.Popen(
        [py, "-m", "gradstar", "coordinator", "--host", "127.0.0.1", "--port", str(port),
         "--heartbeat-timeout", "5", "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=open(out / "hub.log", "w"))
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "world_size": args.world, "steps": args.steps,
                                "batch": args.batch}))
    agent = subprocess.Popen(
        [py, "-m", "gradstar", "worker", "--coordinator", f"127.0.0.1:{port}",
         "--job", "faults", "--nproc", str(args.world), "--world-size", str(args.world),
         "--max-restarts", str(kills + 5), "--", py, __file__, "--rank-spec", str(spec)],
        env={**os.environ, "GRADSTAR_ELASTIC": "1"}, stdout=subprocess.DEVNULL,
        stderr=open(out / "agent.log", "w"))
    began, killed, rng = time.time(), [], random.Random(args.seed)
    try:
        next_kill = began + args.first_kill
        while agent.poll() is None:
            if time.time() - began > args.timeout:
                raise SystemExit(f"the run took over {args.timeout} s; logs in {out}")
            time.sleep(0.1)
            if len(killed) >= kills or time.time() < next_kill:
                continue
            events = read_events(out, args.world)
            if hub_step(events) >= args.quiet_from * args.steps:
                continue
            ready = [r for r, es in events.items()
                     if any(e["event"] == "contributed" for e in current_life(es))]
            if not ready:
                continue
            rank = rng.choice(ready)
            pid = current_life(events[rank])[0]["pid"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append({"rank": rank, "pid": pid, "t": time.time() - began})
            next_kill = time.time() + args.kill_every
        seconds = time.time() - began
    finally:
        for proc in (agent, hub):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return summarize(args, out, agent.returncode, seconds, killed)


def summarize(args, out: Path, agent_code: int, seconds: float, killed: list[dict]) -> dict:
    import numpy as np
    import torch

    from gradstar.worker.demo import spirals as task

    events = read_events(out, args.world)
    errors = [e for es in events.values() for e in es if e["event"] == "error"]
    # Per restarted life that contributed: seconds from its process's start to its first
    # accepted gradient, and the phases (imports; data and init_process_group; DDP's join from
    # the snapshot; the first gradient).
    to_contribute, phases = [], []
    for es in events.values():
        life: dict[str, dict] = {}
        for e in es:
            if e["event"] == "start":
                life = {"start": e} if e["restart"] > 0 else {}
            elif life:
                life[e["event"]] = e
                if e["event"] == "contributed" and "joined" in life and "group" in life:
                    to_contribute.append(e["t"] - life["start"]["started"])
                    marks = [life["start"]["started"], life["start"]["t"], life["group"]["t"],
                             life["joined"]["t"], e["t"]]
                    phases.append([b - a for a, b in itertools.pairwise(marks)])
                    life = {}
    restarts = sum(1 for es in events.values() for e in es
                   if e["event"] == "start" and e["restart"] > 0)
    finals = {r: next((e for e in reversed(es) if e["event"] == "final"), None)
              for r, es in events.items()}
    shas = {f["sha"] for f in finals.values() if f is not None}
    accuracy = None
    if (out / "final0.npy").exists():
        data = task.make_spirals(SAMPLES, seed=0)
        model = task.make_model(data.features, data.classes, HIDDEN)
        task.load_flat_parameters(model, np.load(out / "final0.npy"))
        with torch.no_grad():
            accuracy = task.evaluate(model, data.test)[1]
    return {
        "kills": len(killed), "restarts": restarts, "agent_exit": agent_code,
        "seconds": seconds, "errors": [e["error"] for e in errors],
        "to_contribute_s": sorted(to_contribute),
        "phases_median_s": ([statistics.median(p[i] for p in phases) for i in range(4)]
                            if phases else None),
        "identical": len(shas) == 1 and all(f is not None for f in finals.values()),
        "final_steps": sorted({f["step"] for f in finals.values() if f is not None}),
        "accuracy": accuracy, "killed": killed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10000, help="hub steps to train")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--first-kill", type=float, default=5.0, help="seconds into the run")
    parser.add_argument("--quiet-from", type=float, default=0.8,
                        help="no kill once the hub passed this fraction of the steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)  # a rank process of this file
    args = parser.parse_args()
    if args.rank_spec:
        return rank_main(json.loads(Path(args.rank_spec).read_text()))
    tmp = Path(tempfile.mkdtemp(prefix="gradstar-faults-"))
    print(f"load before: {loadavg()}; logs in {tmp}", flush=True)
    results = {"undisturbed": run(args, 0, tmp / "undisturbed"),
               "faults": run(args, args.kills, tmp / "faults")}
    rows = []
    for name, r in results.items():
        waits = r["to_contribute_s"]
        rows.append([name, f"{r['seconds']:.1f}", str(r["kills"]), str(r["restarts"]),
                     str(len(r["errors"])),
                     f"{statistics.median(waits):.1f} / {max(waits):.1f}" if waits else "-",
                     "yes" if r["identical"] else "NO", ",".join(map(str, r["final_steps"])),
                     f"{r['accuracy']:.4f}" if r["accuracy"] is not None else "-"])
    print(format_table(["run", "seconds", "kills", "restarts", "rank errors",
                        "restart to contribution s (median / max)", "bitwise identical",
                        "final step", "test accuracy"], rows))
    base, hit = results["undisturbed"]["accuracy"], results["faults"]["accuracy"]
    if base is not None and hit is not None:
        print(f"accuracy difference: {100 * (hit - base):+.2f} points")
    phases = results["faults"]["phases_median_s"]
    if phases:
        print("a restart's seconds, medians: imports {:.1f}, data and init_process_group {:.1f}, "
              "DDP's join from the snapshot {:.1f}, first accepted gradient {:.1f}".format(*phases))
    for e in results["faults"]["errors"]:
        print("rank error:", e)
    print(f"load after: {loadavg()}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

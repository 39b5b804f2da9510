"""all_reduce across hosts at link speed: gloo's ring and gradstar's topologies on an emulated
cluster, in one run.

The cluster (:mod:`_emulated_cluster`)
    Every host is a Linux network namespace with one interface on a shared bridge, its link
    limited to ``--rate`` (tc notation, default 200mbit) in BOTH directions by a token bucket
    (tbf on the host's eth0 and on its bridge port). The rank hosts are ``node0`` ..
    ``node{H-1}`` (``--hosts H``, ``--ranks-per-host r``: rank i on node i // r); the extra hosts
    ``hub`` and ``shard0`` .. ``shard{H-1}`` exist only for the topologies that use them. The run
    needs root, ``ip`` and ``tc``, and removes every namespace and process it made however it
    ends (errors, Ctrl-C, SIGTERM; only a SIGKILL of this script leaves them: ``ip netns list``
    shows ``gs-<tag>-*``).

Topologies (the rows; ``--topologies``)
    ``gloo``                torch.distributed gloo all_reduce (its ring), GLOO_SOCKET_IFNAME=eth0,
                            rendezvous on a TCP store at node0's address.
    ``gloo-bf16-hook``      the same with torch's ``bf16_compress_hook`` semantics: the tensor
                            divided by n, cast to bfloat16, all_reduced (added in bfloat16 at
                            every hop of the ring), cast back (and times n for the check).
    ``hub-on-rank0``        ``gradstar coordinator`` on node0, beside rank 0; no shards (what an
                            embedded hub or ``gradstar launch`` gives).
    ``hub-own-host``        the coordinator alone on host ``hub`` (docker-compose's shape).
    ``shards-extra-hosts``  the coordinator on ``hub`` (control plane only) and H ``gradstar
                            shard`` processes, one on each of ``shard0`` .. ``shard{H-1}``.
    ``node-local``          the coordinator on node0 and one ``gradstar shard --for-job`` on
                            every rank host, as gradstar's launchers start them by default
                            (advertised at the address gradstar picks); with several ranks on
                            a host they combine on its shard first (the two-level all_reduce).
    Each gradstar topology is one function below returning a :class:`Placement`; the processes
    are started from it by :func:`start_hub`. With ``--wire F ...`` each gradstar topology has
    a row per wire format (``none``: float32), named e.g. ``node-local wire=int8``: the ranks
    call ``all_reduce(x, wire=F)`` (compressed wire formats, ``gradstar.wire.formats``).

What is measured
    Each rank runs in its host's namespace (``ip netns exec``), with a float32 tensor of
    ``size`` MiB (numpy for gradstar, torch for gloo) whose elements are rank + 1. It runs
    ``--warmup`` all_reduce(sum) calls (checking the result exactly: n(n+1)/2 everywhere), then
    ``--iters`` timed iterations of ``barrier(); t0; all_reduce; t``. Rank 0 tells this script
    (JSON lines on its stdout; a line on its stdin lets the ranks go on) right before and right
    after the timed loop, while every rank waits at a barrier; there this script reads every
    host's link counters and the hub's CPU. Columns:

    * ms: rank 0's median iteration; x gloo: that over gloo's median at the same size.
    * ideal ms: the link-bound time, from the bytes the busiest host link must carry in one
      direction (links are full duplex, the bridge is not a bottleneck), at R bytes/s each way.
      For an all_reduce of S bytes over n ranks, one rank per host (see :func:`link_model`,
      which computes it from the flows for any ranks-per-host, where a host's ranks share its
      link)::

          ring (gloo)                  2(n-1)/n * S / R      every rank sends 2(n-1)/n*S to the next
          hub on rank 0's host         (n-1) * S / R         the hub's link carries the other ranks
          hub on a host of its own     n * S / R             the hub's link carries every rank's S
          K shards on extra hosts      max(S, n*S/K) / R     each rank S each way; a shard n*S/K
          node-local shards (K = H)    2(H-1)/H * S / R      S/H to and from each other host,
                                                             whatever the ranks per host

      This ignores latency and headers (TCP/IP, gRPC framing: a few per cent).
    * eff: ideal / ms.
    * link MB: bytes per collective over the busiest host link (the larger direction), from the
      veth counters over the timed loop divided by ``--iters`` (the barriers' few bytes
      included); model MB: what the flows above put there. A second table lists every host's
      link, out/in.
    * CPU-s/GB: CPU seconds over the timed loop per GB (1e9 bytes) of payload, S x n x iters.
      hub: the coordinator and its shards (user + system from /proc/PID/stat); ranks: the sum
      of the ranks' ``time.process_time()`` over the loop.

Shared memory: a gradstar rank reaches a hub or shard on its own host through shared memory,
and streams to the others: gradstar tells hosts apart by boot id and network namespace
(``gradstar.transport.shm.host_id``), so each namespace here is a host of its own, and the
ranks run with gradstar's default (no ``GRADSTAR_SHARED_MEMORY`` set).

Every wait is bounded (``--timeout`` per topology and size); a row that fails is reported with
its error and the run goes on; the exit status is 1 if any row failed.

How to reproduce (as root)::

    .venv/bin/python benchmarks/cluster.py --hosts 4 --ranks-per-host 1 --sizes-mb 16 64 \\
        --iters 5
    .venv/bin/python benchmarks/cluster.py --hosts 2 --ranks-per-host 2 --sizes-mb 1 \\
        --topologies gloo node-local --rate 100mbit --json /tmp/cluster.json
    # compressed wire formats against gloo and gloo + bf16 hook (issue 25's targets)
    .venv/bin/python benchmarks/cluster.py --hosts 4 --sizes-mb 64 --iters 3 \\
        --topologies gloo gloo-bf16-hook node-local --wire none bf16 int8 int4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _emulated_cluster import (
    CONGESTION_CONTROL,
    ClusterUnavailable,
    EmulatedCluster,
    LinkBytes,
    rate_bytes_per_second,
)
from _harness import (
    BenchmarkError,
    MiB,
    cpu_seconds_of,
    format_table,
    loadavg,
    median,
)

REPO = Path(__file__).resolve().parents[1]
COORDINATOR_PORT = 29400  # each host is a fresh namespace: nothing else listens there
STORE_PORT = 29500
DDP_BATCH = 32  # rows per rank per step, as benchmarks/ddp_step.py
MB = 1e6
GB = 1e9


# -- placements: where each process of a topology runs ------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The run's rank hosts and ranks: rank i runs on ``rank_hosts[i]``."""

    hosts: int
    ranks_per_host: int

    @property
    def nodes(self) -> list[str]:
        return [f"node{h}" for h in range(self.hosts)]

    @property
    def rank_hosts(self) -> list[str]:
        return [f"node{r // self.ranks_per_host}"
                for r in range(self.hosts * self.ranks_per_host)]

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host


@dataclass(frozen=True)
class Placement:
    """Where a topology runs its hub: the coordinator's host (None: gloo, no hub) and one host
    per shard (slot k on ``shard_hosts[k]``; empty: the coordinator carries the collectives)."""

    coordinator: str | None
    shard_hosts: tuple[str, ...] = ()
    #: The shards are node-local ones, as gradstar's launchers start them: registered for the
    #: row's job (``--for-job``; each size's job is a subgroup of it), advertised at the
    #: address gradstar picks by default, and a host's ranks combine on theirs first.
    node_local: bool = False
    #: gloo with torch's bf16_compress_hook semantics (bfloat16 on the wire, added per hop).
    bf16_hook: bool = False


def gloo(layout: Layout) -> Placement:
    return Placement(None)


def gloo_bf16_hook(layout: Layout) -> Placement:
    return Placement(None, bf16_hook=True)


def hub_on_rank0(layout: Layout) -> Placement:
    return Placement(layout.rank_hosts[0])


def hub_own_host(layout: Layout) -> Placement:
    return Placement("hub")


def shards_extra_hosts(layout: Layout) -> Placement:
    return Placement("hub", tuple(f"shard{k}" for k in range(layout.hosts)))


def node_local(layout: Layout) -> Placement:
    """One shard on each rank host, started as ``gradstar worker``, ``gradstar launch
    --coordinator`` and the env:// drop-in start them (gradstar.node_shard): ``gradstar shard
    --for-job JOB`` with the address it advertises by default."""
    return Placement(layout.rank_hosts[0], tuple(layout.nodes), node_local=True)


TOPOLOGIES: dict[str, Callable[[Layout], Placement]] = {
    "gloo": gloo, "gloo-bf16-hook": gloo_bf16_hook, "hub-on-rank0": hub_on_rank0,
    "hub-own-host": hub_own_host, "shards-extra-hosts": shards_extra_hosts,
    "node-local": node_local}
#: The rows of a run without --topologies (the compressed gloo row is asked for by name).
DEFAULT_TOPOLOGIES = [name for name in TOPOLOGIES if name != "gloo-bf16-hook"]


def extra_hosts(names: Sequence[str], layout: Layout) -> list[str]:
    """The hosts beyond the rank hosts that ``names`` need, in a stable order."""
    needed: list[str] = []
    for name in names:
        placement = TOPOLOGIES[name](layout)
        for host in (placement.coordinator, *placement.shard_hosts):
            if host is not None and host not in layout.nodes and host not in needed:
                needed.append(host)
    return needed


# -- the link model -----------------------------------------------------------------------------


def link_model(placement: Placement, layout: Layout, nbytes: int,
               wire: str | None = None) -> dict[str, LinkBytes]:
    """The bytes each host's link carries per all_reduce of ``nbytes``, from the flows alone.

    gloo: rank i sends 2(n-1)/n of the tensor to rank i+1 (its ring). gradstar: each rank
    sends 1/K of the tensor to each of the K shards (the coordinator when K = 0) and gets as
    much back. A flow between two ranks' processes on one host crosses no link. A wire format
    (or the bf16 hook) scales every flow by its bytes per float32 byte.
    """
    n = layout.world_size
    if wire is not None:
        from gradstar.wire.formats import wire_format

        nbytes = nbytes * wire_format(wire).ratio()
    elif placement.bf16_hook:
        nbytes = nbytes / 2
    flows: list[tuple[str, str, float]] = []
    if placement.node_local:  # a host's ranks combine first: one S/K flow per host and shard
        targets = placement.shard_hosts
        for host in layout.nodes:
            for target in targets:
                flows += [(host, target, nbytes / len(targets)),
                          (target, host, nbytes / len(targets))]
    elif placement.coordinator is None:
        hosts = layout.rank_hosts
        flows = [(hosts[i], hosts[(i + 1) % n], 2 * (n - 1) / n * nbytes) for i in range(n)]
    else:
        targets = list(placement.shard_hosts) or [placement.coordinator]
        for host in layout.rank_hosts:
            for target in targets:
                flows += [(host, target, nbytes / len(targets)),
                          (target, host, nbytes / len(targets))]
    tx: dict[str, float] = {}
    rx: dict[str, float] = {}
    for src, dst, size in flows:
        if src != dst:
            tx[src] = tx.get(src, 0.0) + size
            rx[dst] = rx.get(dst, 0.0) + size
    return {h: LinkBytes(round(rx.get(h, 0)), round(tx.get(h, 0))) for h in {*tx, *rx}}


def busiest(links: dict[str, LinkBytes]) -> float:
    return max((max(b.rx, b.tx) for b in links.values()), default=0.0)


# -- the rank program ---------------------------------------------------------------------------


def ddp_step(wrap: Callable, rank: int) -> tuple[Callable, Callable]:
    """``benchmarks/ddp_step.py``'s model, data and SGD step, its gradients reduced by the
    DDP wrapper ``wrap`` returns: (one training step, a sample of the parameters now)."""
    import torch
    from ddp_step import SAMPLE_EVERY, _data, _model

    torch.set_num_threads(1)  # every rank shares the machine's cores with the others
    model = _model(seed=rank)  # different seeds: DDP's first broadcast must align them
    step_model = wrap(model)
    x, y = _data(rank, DDP_BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(step_model(x), y).backward()
        opt.step()

    def sample() -> list[float]:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        return flat[::SAMPLE_EVERY].tolist()

    return step, sample


def rank_main(spec: dict) -> int:
    """One rank: join, warm up, report the timed loop. Rank 0 prints ``{"phase": ...}`` lines
    and waits for a line on stdin at each; every rank ends with a ``{"result": ...}`` line."""
    import numpy as np

    rank, n, iters = spec["rank"], spec["world_size"], spec["iters"]
    numel = spec["nbytes"] // 4
    want = n * (n + 1) / 2
    # Compressed rows are exact to the format's rounding (these inputs are constant per rank).
    lossy = spec.get("wire") is not None or spec.get("bf16_hook", False)
    if spec["backend"] == "gloo":
        import datetime

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=spec["store"], rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=spec["timeout"]))
        saved = torch.full((numel,), float(rank + 1), dtype=torch.float32)
        x = saved.clone()

        def all_reduce():
            if spec.get("bf16_hook"):  # torch's bf16_compress_hook: divide, cast, sum, cast back
                t = (saved / n).to(torch.bfloat16)
                dist.all_reduce(t)
                return t.to(torch.float32).numpy() * n
            x.copy_(saved)  # gloo reduces in place
            dist.all_reduce(x)
            return x.numpy()

        barrier, close, shards = dist.barrier, dist.destroy_process_group, None
        def wrap(model):
            return torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=spec["bucket_cap_mb"])
    else:
        import gradstar

        options = {"chunk_bytes": spec["chunk_bytes"]} if spec["chunk_bytes"] else {}
        pg = gradstar.init_process_group(rank=rank, timeout=spec["timeout"], join_timeout=120,
                                         **options)
        if len(pg.shards) != spec["shards"]:
            raise SystemExit(f"rank {rank}: striped over {pg.shards}, expected "
                             f"{spec['shards']} shards")
        x = np.full(numel, rank + 1, dtype=np.float32)

        def all_reduce():
            return pg.all_reduce(x, wire=spec.get("wire"))

        barrier, close, shards = pg.barrier, pg.close, pg.shards

        def wrap(model):
            return gradstar.DDP(model, pg, bucket_cap_mb=spec["bucket_cap_mb"])

    if spec["workload"] == "ddp":
        all_reduce, final = ddp_step(wrap, rank)
    else:
        final = None

    def check(result) -> None:
        if final is not None:
            return  # a DDP step: the ranks' final parameters are compared by the driver
        if lossy:
            if not (np.abs(result - want) <= want * 2.0**-6).all():
                raise SystemExit(f"rank {rank}: wrong all_reduce result (want {want} to the "
                                 "format's rounding)")
            return
        if not (result[0] == want and result[-1] == want and (result == want).all()):
            raise SystemExit(f"rank {rank}: wrong all_reduce result (want {want})")

    def phase(name: str) -> None:
        barrier()
        if rank == 0:
            print(json.dumps({"phase": name}), flush=True)
            if not sys.stdin.readline():
                raise SystemExit("rank 0: the benchmark went away")
        barrier()

    for _ in range(spec["warmup"]):
        check(all_reduce())
    phase("start")
    times = []
    cpu = time.process_time()
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        result = all_reduce()
        times.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu
    check(result)
    phase("end")
    print(json.dumps({"result": {"rank": rank, "times": times, "cpu_s": cpu,
                                 "shards": shards, "sample": final and final()}}), flush=True)
    close()
    return 0


# -- running a topology -------------------------------------------------------------------------


@dataclass
class Process:
    """A process in a host, its output in a log file; :meth:`wait_for` a line of it."""

    name: str
    proc: subprocess.Popen
    log: Path
    lines: queue.Queue = field(default_factory=queue.Queue)

    def start_reader(self) -> None:
        def pump() -> None:
            with self.log.open("a") as out:
                for line in self.proc.stdout:
                    out.write(line)
                    out.flush()
                    self.lines.put(line)
            self.lines.put(None)

        threading.Thread(target=pump, daemon=True, name=f"{self.name}-out").start()

    def next_line(self, deadline: float, what: str) -> str:
        """The next line of output; raises BenchmarkError on exit or at ``deadline``."""
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise BenchmarkError(f"{self.name}: no {what} in time\n{self.tail()}") from None
        if line is None:
            self.lines.put(None)
            raise BenchmarkError(f"{self.name} exited ({self.proc.wait()}) before {what}\n"
                                 f"{self.tail()}")
        return line

    def wait_for(self, text: str, deadline: float) -> str:
        while True:
            line = self.next_line(deadline, repr(text))
            if text in line:
                return line

    def tail(self, chars: int = 2500) -> str:
        return f"--- {self.name} ({self.log}) ---\n" + \
            self.log.read_text(errors="replace")[-chars:]


@dataclass
class Run:
    """What every row shares: the cluster, the layout, tokens, options, and a log folder."""

    cluster: EmulatedCluster
    layout: Layout
    args: argparse.Namespace
    logs: Path
    token: str = field(default_factory=secrets.token_urlsafe)
    admin_token: str = field(default_factory=secrets.token_urlsafe)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADSTAR_", "GLOO_"))}
        return env | {"PYTHONUNBUFFERED": "1", **extra}

    def start(self, host: str, name: str, argv: Sequence[str], env: dict[str, str], *,
              stdin: bool = False) -> Process:
        log = self.logs / f"{name}.log"
        with log.open("w") as err:
            proc = self.cluster.popen(host, argv, env=env, cwd=REPO, text=True, bufsize=1,
                                      stdout=subprocess.PIPE, stderr=err,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        started = Process(name, proc, log)
        started.start_reader()
        return started


def start_hub(run: Run, label: str, placement: Placement, deadline: float) -> list[Process]:
    """Start ``placement``'s coordinator and shards and wait until the coordinator serves with
    all its shards; returns them, coordinator first."""
    env = run.env(GRADSTAR_TOKEN=run.token, GRADSTAR_ADMIN_TOKEN=run.admin_token)
    k = len(placement.shard_hosts)
    coordinator = run.start(placement.coordinator, f"{label}-coordinator", [
        sys.executable, "-u", "-m", "gradstar", "coordinator", "--host", "0.0.0.0",
        "--port", str(COORDINATOR_PORT), "--shards", "0", "--expected-shards", str(k),
        "--log-level", "WARNING"], env)
    hub = [coordinator]
    try:
        address = f"{run.cluster.address(placement.coordinator)}:{COORDINATOR_PORT}"
        if k:
            coordinator.wait_for("gradstar coordinator bound to", deadline)
        for slot, host in enumerate(placement.shard_hosts):
            where = (["--for-job", label] if placement.node_local else
                     ["--advertise-host", run.cluster.address(host)])
            hub.append(run.start(host, f"{label}-shard{slot}", [
                sys.executable, "-u", "-m", "gradstar", "shard", "--coordinator", address,
                "--host", "0.0.0.0", "--port", "0", *where, "--slot", str(slot),
                "--log-level", "WARNING"], env))
        coordinator.wait_for("gradstar coordinator listening on", deadline)
    except BaseException:
        run.cluster.stop_processes([p.proc for p in hub])
        raise
    return hub


def rank_env(run: Run, placement: Placement, job: str) -> dict[str, str]:
    if placement.coordinator is None:
        return run.env(GLOO_SOCKET_IFNAME="eth0")
    address = f"{run.cluster.address(placement.coordinator)}:{COORDINATOR_PORT}"
    return run.env(GRADSTAR_COORDINATOR=address, GRADSTAR_JOB=job, GRADSTAR_TOKEN=run.token,
                   GRADSTAR_WORLD_SIZE=str(run.layout.world_size))


@dataclass
class Sample:
    links: dict[str, LinkBytes]
    hub_cpu: float
    at: float


def sample(run: Run, hub: list[Process]) -> Sample:
    cpu = sum(cpu_seconds_of(p.proc.pid) or 0.0 for p in hub)
    return Sample(run.cluster.link_bytes(), cpu, time.monotonic())


def run_size(run: Run, name: str, placement: Placement, hub: list[Process], size_mb: float,
             deadline: float, wire: str | None = None) -> dict:
    """The ranks of one row at one size (``wire``: the gradstar ranks' wire format); returns
    the row's measurements."""
    layout, args = run.layout, run.args
    nbytes = int(size_mb * MiB) // 4 * 4
    label = f"{name}-{size_mb:g}MiB" + (f"-{wire}" if wire else "")
    store = f"tcp://{run.cluster.address(layout.rank_hosts[0])}:{STORE_PORT}"
    ranks = []
    try:
        for rank, host in enumerate(layout.rank_hosts):
            spec = {"backend": "gloo" if placement.coordinator is None else "gradstar",
                    "workload": args.workload, "bucket_cap_mb": args.bucket_cap_mb,
                    "rank": rank,
                    "world_size": layout.world_size, "nbytes": nbytes,
                    "iters": args.iters, "warmup": args.warmup, "store": store,
                    "timeout": args.timeout, "shards": len(placement.shard_hosts),
                    "chunk_bytes": int(args.chunk_mb * MiB) if args.chunk_mb else None,
                    "wire": wire, "bf16_hook": placement.bf16_hook}
            ranks.append(run.start(host, f"{label}-rank{rank}",
                                   [sys.executable, "-u", __file__, "--rank-spec",
                                    json.dumps(spec)],
                                   rank_env(run, placement, f"{name}/{size_mb:g}MiB"
                                            + (f"/{wire}" if wire else "")),
                                   stdin=rank == 0))
        samples = []
        for phase in ("start", "end"):
            line = ranks[0].wait_for('"phase"', deadline)
            if json.loads(line)["phase"] != phase:
                raise BenchmarkError(f"{label}: rank 0 said {line.strip()}, expected {phase}")
            samples.append(sample(run, hub))
            ranks[0].proc.stdin.write("go\n")
            ranks[0].proc.stdin.flush()
        results = [json.loads(r.wait_for('"result"', deadline))["result"] for r in ranks]
        for r in ranks:
            r.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (BenchmarkError, subprocess.TimeoutExpired, OSError, ValueError) as error:
        raise BenchmarkError(f"{label}: {error}\n" + "\n".join(r.tail() for r in ranks)) \
            from None
    finally:
        run.cluster.stop_processes([r.proc for r in ranks])
    if args.workload == "ddp":
        for r in results[1:]:
            if r["sample"] != results[0]["sample"]:
                raise BenchmarkError(f"{label}: rank {r['rank']}'s parameters differ from "
                                     "rank 0's: the replicas diverged")
    before, after = samples
    links = {h: LinkBytes(round((after.links[h] - before.links[h]).rx / args.iters),
                          round((after.links[h] - before.links[h]).tx / args.iters))
             for h in after.links}
    gb = nbytes * layout.world_size * args.iters / GB
    model = link_model(placement, layout, nbytes, wire)
    rate = rate_bytes_per_second(args.rate)
    return {"topology": name + (f" wire={wire}" if wire else ""), "size_mb": size_mb,
            "nbytes": nbytes, "wire": wire,
            "median_s": median(results[0]["times"]), "times": results[0]["times"],
            "ideal_s": busiest(model) / rate, "links": {h: vars(b) for h, b in links.items()},
            "model": {h: vars(b) for h, b in model.items()},
            "hub_cpu_s_per_gb": (after.hub_cpu - before.hub_cpu) / gb if hub else None,
            "ranks_cpu_s_per_gb": sum(r["cpu_s"] for r in results) / gb,
            "shards": results[0]["shards"], "sample": results[0]["sample"]}


def run_topology(run: Run, name: str) -> tuple[list[dict], list[tuple[str, str]]]:
    """Every size of one row: its hub started once, fresh ranks (and job) per size."""
    placement = TOPOLOGIES[name](run.layout)
    rows, failures = [], []
    hub: list[Process] = []
    try:
        if placement.coordinator is not None:
            hub = start_hub(run, name, placement, time.monotonic() + 60)
        wires = [None] if placement.coordinator is None else [
            None if w == "none" else w for w in run.args.wire]
        for size_mb in run.args.sizes_mb:
            for wire in wires:
                what = name + (f" wire={wire}" if wire else "")
                t0 = time.monotonic()
                try:
                    row = run_size(run, name, placement, hub, size_mb, t0 + run.args.timeout,
                                   wire)
                except BenchmarkError as error:
                    failures.append((f"{what} {size_mb:g} MiB", str(error)))
                    print(f"  {what:30s} {size_mb:6g} MiB FAILED", file=sys.stderr, flush=True)
                    continue
                rows.append(row)
                print(f"  {what:30s} {size_mb:6g} MiB median {row['median_s'] * 1e3:9.1f} ms "
                      f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    except BenchmarkError as error:
        failures.append((name, str(error)))
        print(f"  {name:20s} FAILED to start", file=sys.stderr, flush=True)
    finally:
        run.cluster.stop_processes([p.proc for p in hub])
    return rows, failures


# -- report -------------------------------------------------------------------------------------


def tables(rows: list[dict]) -> str:
    gloo_s = {r["size_mb"]: r["median_s"] for r in rows if r["topology"] == "gloo"}

    def mb(x: float) -> str:
        return f"{x / MB:.1f}"

    def cpu(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    main = [[r["topology"], f"{r['size_mb']:g}", f"{r['median_s'] * 1e3:.0f}",
             f"{r['median_s'] / gloo_s[r['size_mb']]:.2f}" if r["size_mb"] in gloo_s else "-",
             f"{r['ideal_s'] * 1e3:.0f}", f"{r['ideal_s'] / r['median_s']:.0%}",
             mb(busiest({h: LinkBytes(**b) for h, b in r["links"].items()})),
             mb(busiest({h: LinkBytes(**b) for h, b in r["model"].items()})),
             cpu(r["hub_cpu_s_per_gb"]), cpu(r["ranks_cpu_s_per_gb"])] for r in rows]
    out = format_table(["topology", "MiB", "ms", "x gloo", "ideal ms", "eff", "link MB",
                        "model MB", "hub CPU-s/GB", "ranks CPU-s/GB"], main)
    hosts = sorted({h for r in rows for h, b in r["links"].items() if b["rx"] + b["tx"] > 1e5},
                   key=lambda h: (not h.startswith("node"), h))
    per_host = [[r["topology"], f"{r['size_mb']:g}",
                 *(f"{mb(r['links'][h]['tx'])}/{mb(r['links'][h]['rx'])}" for h in hosts)]
                for r in rows]
    out += "\n\nMB per collective over each host's link, out/in (veth counters):\n"
    return out + format_table(["topology", "MiB", *hosts], per_host)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4, help="rank hosts (default 4)")
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64],
                        help="float32 payload per rank in MiB (default 1 16 64)")
    parser.add_argument("--rate", default="200mbit",
                        help="each host link's rate each way, tc notation (default 200mbit)")
    parser.add_argument("--workload", choices=["all_reduce", "ddp"], default="all_reduce",
                        help="all_reduce: of --sizes-mb; ddp: benchmarks/ddp_step.py's DDP "
                             "training step (its 37.7 MB of gradients; --sizes-mb ignored)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="--workload ddp: both DDPs' bucket size (default 25, torch's)")
    parser.add_argument("--congestion-control", default=CONGESTION_CONTROL,
                        help="each host's TCP congestion control (default cubic, Linux's "
                             "default; 'inherit' keeps the machine's)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations (default 1)")
    parser.add_argument("--chunk-mb", type=float,
                        help="gradstar ranks' chunk size in MiB (default: the client's)")
    parser.add_argument("--topologies", nargs="+", choices=list(TOPOLOGIES),
                        default=DEFAULT_TOPOLOGIES)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed per topology and size (default 300)")
    parser.add_argument("--wire", nargs="+", default=["none"],
                        choices=["none", "bf16", "fp16", "int8", "int4"],
                        help="gradstar rows per wire format (default: none, float32)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rank-spec", help=argparse.SUPPRESS)  # a rank process of this script
    args = parser.parse_args(argv)
    if args.rank_spec:
        return rank_main(json.loads(args.rank_spec))
    if args.hosts < 2 or args.ranks_per_host < 1 or args.iters < 1:
        parser.error("--hosts must be at least 2, --ranks-per-host and --iters at least 1")
    rate_bytes_per_second(args.rate)
    if args.workload == "ddp" and args.wire != ["none"]:
        parser.error("--wire applies to the all_reduce workload (gradstar.DDP takes no wire "
                     "format yet)")

    # Ctrl-C (even where a shell started this with SIGINT ignored), SIGTERM and SIGHUP end the
    # run through the finally blocks that clean up.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _: sys.exit(128 + s))
    if args.workload == "ddp":  # one "size": the model's gradients
        from itertools import pairwise

        from ddp_step import WIDTHS

        params = sum(a * b + b for a, b in pairwise(WIDTHS))
        args.sizes_mb = [params * 4 / MiB]
    layout = Layout(args.hosts, args.ranks_per_host)
    names = layout.nodes + extra_hosts(args.topologies, layout)
    rows: list[dict] = []
    failures: list[tuple[str, str]] = []
    logs = Path(tempfile.mkdtemp(prefix="gradstar-cluster-"))
    try:
        congestion = None if args.congestion_control == "inherit" else args.congestion_control
        with EmulatedCluster(names, rate=args.rate, congestion_control=congestion) as cluster:
            print(cluster.describe(), file=sys.stderr, flush=True)
            run = Run(cluster, layout, args, logs)
            for name in args.topologies:
                got, failed = run_topology(run, name)
                rows += got
                failures += failed
    except ClusterUnavailable as error:
        print(f"benchmarks/cluster.py: no emulated cluster here: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("benchmarks/cluster.py: interrupted; its processes and namespaces are gone",
              file=sys.stderr)
        return 130
    finally:
        if not failures:
            shutil.rmtree(logs, ignore_errors=True)
    what = ("DDP step of benchmarks/ddp_step.py's MLP (MiB: its float32 gradients; ideal: "
            "their all_reduce alone)" if args.workload == "ddp" else "all_reduce, float32")
    print(f"\n{what}, {layout.hosts} hosts x {layout.ranks_per_host} ranks, each "
          f"host link {args.rate} each way; {args.iters} timed iterations (median), "
          f"{args.warmup} warm-up; load {loadavg()}")
    print("ideal = busiest host link's bytes in one direction / rate: ring 2(n-1)/n*S, hub on "
          "rank 0's host (n-1)*S, hub on its own host n*S, K extra-host shards max(S, n*S/K), "
          "node-local shards 2(n-1)/n*S (one rank per host)\n")
    print(tables(rows))
    for name, error in failures:
        print(f"\nFAILED {name}:\n{error}")
    if failures:
        print(f"\nEvery process's output: {logs}")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "cluster", "args": vars(args) | {"json": str(args.json)},
            "machine": platform.platform(), "cpus": os.cpu_count(), "rows": rows,
            "failures": failures}, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

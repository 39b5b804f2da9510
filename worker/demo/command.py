"""``gradstar demo``: the main job. An embedded coordinator and N local rank processes train the
spirals MLP (:mod:`gradstar.worker.demo.train`), with a progress bar per epoch and a report.

The report says how well the model learned (loss, accuracy), how fast (samples per second),
how many bytes went through the hub (the Admin service's counters of the job), and whether the
distributed run computed what one process computes:

- *replay*: the ranks save their state every ``CHECK_EVERY`` steps; each stretch between two
  saves is re-run in this process from the state at its start
  (:class:`~gradstar.worker.demo.replay.SingleProcessRun`) and must end within float32 rounding
  (``REPLAY_TOLERANCE``) of the state the ranks saved at its end. Stretches are checked on
  their own because SGD on a non-convex loss amplifies rounding differences (the ranks'
  gradients are summed in another order than one process sums its batch, and the hub adds them
  in arrival order) until, hundreds of steps later, whole runs differ visibly;
- *from scratch*: one process trains the same schedule from the start, and its accuracy and
  predictions are compared with the distributed model's.

``--report FILE.json`` writes all of it as data and ``--plot FILE.png`` draws loss and test
accuracy per epoch beside the from-scratch run (:mod:`.report`).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..host.supervisor import RankSupervisor, rank_env
from .replay import SingleProcessRun, checkpoint_steps, rank_states, replica_states
from .report import plot_unavailable, report_data, write_artefacts
from .train import TrainSettings

MODES = ("ddp", "fsdp", "pipeline", "localsgd", "streaming-diloco")
#: Largest parameter difference between a stretch of the distributed run and its replay in one
#: process. Rounding differences over 25 steps measure around 1e-6 here (1e-7 to 2e-6 over the
#: default run); a wrong gradient or a skipped update moves parameters by far more than this.
REPLAY_TOLERANCE = 1e-4
#: Steps between the ranks' saved states, i.e. the length of each replayed stretch.
CHECK_EVERY = 25
#: Exit code when the distributed result does not match the single-process run.
EXIT_MISMATCH = 3

#: What the modes other than ddp and localsgd need, which other parts of gradstar provide.
_NEEDS = {
    "fsdp": ("gradstar.FSDP", "gradstar.client.fsdp", "FullyShardedDataParallel"),
    "pipeline": ("gradstar.Pipeline", "gradstar.client.pipeline", "Pipeline"),
}
#: The MLP's layers (Linear, SiLU, Linear, SiLU, Linear): a pipeline has at most this many stages.
PIPELINE_MAX_STAGES = 5


@dataclass(frozen=True)
class DemoOptions:
    workers: int = 4
    mode: str = "ddp"
    epochs: int = 20
    samples: int = 24_000
    batch_size: int = 64
    hidden: int = 128
    lr: float = 0.1
    sync_every: int = 4
    seed: int = 0
    #: Where to write the loss/accuracy plot (PNG) and the JSON report (see .report).
    plot: Path | None = None
    report: Path | None = None


def mode_unavailable(mode: str, workers: int = 1) -> str | None:
    """Why ``mode`` cannot run in this build on ``workers`` ranks, or None if it can."""
    if mode not in MODES:
        return f"unknown mode {mode!r}; choose one of {', '.join(MODES)}"
    if mode == "pipeline" and workers > PIPELINE_MAX_STAGES:
        return (f"mode 'pipeline' runs one stage of the MLP's {PIPELINE_MAX_STAGES} layers per "
                f"worker, so at most {PIPELINE_MAX_STAGES} workers, not {workers}")
    if mode not in _NEEDS:
        return None
    public, module, cls = _NEEDS[mode]
    import importlib

    try:
        found = getattr(importlib.import_module(module), cls, None) is not None
    except ImportError:
        found = False
    if not found:
        return (f"mode {mode!r} needs {public} ({module}.{cls}), which this build of gradstar "
                "does not have; the modes that run without it are 'ddp' and 'localsgd'")
    return None


class EpochBars:
    """Rank 0's progress events as one bar per epoch: redrawn in place on a terminal, printed
    once per finished epoch otherwise (logs, pipes)."""

    WIDTH = 30

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        utf8 = (getattr(self.stream, "encoding", "") or "").lower().replace("-", "") == "utf8"
        self.full, self.empty = ("█", "·") if utf8 else ("#", "-")
        self.epochs = self.steps = 0
        self.start: dict = {}
        self.done: dict = {}
        self.epoch_events: list[dict] = []

    def _bar(self, epoch: int, step: int, tail: str) -> str:
        filled = self.WIDTH * step // max(self.steps, 1)
        bar = self.full * filled + self.empty * (self.WIDTH - filled)
        width = len(str(self.epochs))
        return (f"epoch {epoch:>{width}}/{self.epochs} |{bar}| {step:>{len(str(self.steps))}}/"
                f"{self.steps}  {tail}")

    def on_event(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "start":
            self.start = event
            self.epochs, self.steps = event["epochs"], event["steps_per_epoch"]
        elif kind == "step" and self.tty:
            line = self._bar(event["epoch"], event["step"], f"loss {event['loss']:.4f}")
            self.stream.write("\r" + line)
            self.stream.flush()
        elif kind == "epoch":
            self.epoch_events.append(event)
            line = self._bar(event["epoch"], self.steps,
                             f"loss {event['loss']:.4f}  test acc {event['test_accuracy']:.1%}  "
                             f"{event['seconds']:.1f} s")
            self.stream.write(("\r" if self.tty else "") + line + "\n")
            self.stream.flush()
        elif kind == "done":
            self.done = event


def _print(text: str = "") -> None:
    print(text, flush=True)


def run_demo(options: DemoOptions) -> int:
    """Run the demo end to end and print its report; return the process exit code."""
    import asyncio

    from gradstar.config import CoordinatorSettings
    from gradstar.coordinator import EmbeddedCoordinator

    if options.mode == "streaming-diloco":  # replicas, not ranks: a demo of its own
        from .streaming import run_streaming_demo

        return run_streaming_demo(options)
    problem = mode_unavailable(options.mode, options.workers)
    if problem is None and options.plot is not None:
        problem = plot_unavailable()
    if problem is not None:
        print(f"gradstar demo: {problem}", file=sys.stderr)
        return 2
    settings = TrainSettings(mode=options.mode, epochs=options.epochs, samples=options.samples,
                             batch_size=options.batch_size, hidden=options.hidden, lr=options.lr,
                             sync_every=options.sync_every, seed=options.seed)
    job = f"demo-{options.mode}"
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gradstar-demo-") as tmp:
        out = Path(tmp)
        # A private hub: no token, TLS or state directory from GRADSTAR_* variables of the
        # shell (the ranks get none of those either).
        hub_settings = CoordinatorSettings(
            host="127.0.0.1", port=0, token=None, admin_token=None, tls_cert=None, tls_key=None,
            tls_client_ca=None, state_dir=None, metrics_port=None)
        with EmbeddedCoordinator(hub_settings) as hub:
            _print(f"gradstar demo: {options.mode} on {options.workers} worker processes, "
                   f"coordinator {hub.address} (embedded)")
            _describe_task(settings, options.workers)
            bars = EpochBars()
            supervisor = _supervisor(options, settings, hub.address, job, out, bars)
            outcome = asyncio.run(supervisor.run())
            if outcome.exit_code != 0:
                print(outcome.message, file=sys.stderr)
                print("demo FAILED: training did not complete", file=sys.stderr)
                failed = report_data(options, time.monotonic() - began, outcome.exit_code,
                                      {options.mode: {"job": job, "epochs": _epochs(bars)}},
                                      error=outcome.message)
                write_artefacts(options, failed)
                return outcome.exit_code
            traffic = job_counters(hub.address, job)
        return _report(options, settings, out, bars, traffic, began)


def _describe_task(settings: TrainSettings, workers: int) -> None:
    from .spirals import make_spirals

    data = make_spirals(settings.samples, seed=settings.seed)
    widths = [data.features, settings.hidden, settings.hidden, data.classes]
    params = sum(a * b + b for a, b in itertools.pairwise(widths))  # weights and biases
    how = {"ddp": "gradients averaged through the hub every step",
           "localsgd": f"LocalSGD: parameters averaged every {settings.sync_every} steps",
           "fsdp": f"FSDP: parameters, gradients and momentum sharded over {workers} ranks",
           "pipeline": f"Pipeline: {workers} stages, {workers} micro-batches a step"}
    _print(f"  data   {data.classes} interleaved spirals: {len(data.train):,} training and "
           f"{len(data.test):,} test points, generated from seed {settings.seed}")
    _print(f"  model  MLP {'-'.join(map(str, widths))} ({params:,} parameters), SGD lr "
           f"{settings.lr:g} momentum {settings.momentum:g}; {how[settings.mode]}")


def _supervisor(options: DemoOptions, settings: TrainSettings, address: str, job: str,
                out: Path, bars: EpochBars) -> RankSupervisor:
    argv = [sys.executable, "-m", "gradstar.worker.demo.train", "--mode", settings.mode,
            "--epochs", str(settings.epochs), "--samples", str(settings.samples),
            "--batch-size", str(settings.batch_size), "--hidden", str(settings.hidden),
            "--lr", repr(settings.lr), "--sync-every", str(settings.sync_every),
            "--seed", str(settings.seed), "--max-rejoins", "0", "--progress", "json",
            "--out", str(out), "--checkpoint-every", str(CHECK_EVERY)]
    # The demo's own settings win over GRADSTAR_TRAIN_* or a token the shell may have set.
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}

    # gRPC's C core logs connection shutdowns at INFO when a peer stream closes; not news here.
    base.setdefault("GRPC_VERBOSITY", "ERROR")

    def env_for(local_rank: int, restart: int) -> dict[str, str]:
        return rank_env(base, coordinator=address, job=job, world_size=options.workers,
                        local_rank=local_rank, nproc=options.workers, restart=restart,
                        rank=local_rank)

    def on_line(local_rank: int, stream: str, line: str) -> None:
        # One rank reports (the last stage of a pipeline, rank 0 otherwise).
        if stream == "stdout" and line.startswith('{"event"'):
            bars.on_event(json.loads(line))
        else:
            print(f"[rank {local_rank}] {line}", file=sys.stderr, flush=True)

    return RankSupervisor(argv, options.workers, env_for, on_line=on_line,
                          log=lambda message: None, name="gradstar demo")


def job_counters(address: str, job: str) -> dict:
    """The Admin service's view of ``job``: bytes in and out of the hub and collective counts."""
    import asyncio

    from ..admin.client import AdminClient
    from ..admin.tables import op_name

    async def read():
        async with AdminClient(address) as admin:
            return await admin.job(job)

    reply = asyncio.run(read())
    ops = {op_name(o.op): (o.completed, o.failed) for o in reply.ops}
    return {"bytes_in": reply.bytes_in, "bytes_out": reply.bytes_out, "ops": ops,
            "generation": reply.summary.generation}


def _report(options: DemoOptions, settings: TrainSettings, out: Path, bars: EpochBars,
            traffic: dict, began: float) -> int:
    run = _measure(options, settings, out, bars, traffic)
    _print_report(run, settings, options.workers)
    exit_code = 0 if run["match"] else EXIT_MISMATCH
    report = report_data(options, time.monotonic() - began, exit_code, {settings.mode: run})
    written = write_artefacts(options, report)
    if written is not None:
        return written
    total = time.monotonic() - began
    if run["match"]:
        _print(f"demo passed in {total:.0f} s: the distributed run matches the single-process run")
        return 0
    _print(f"demo FAILED in {total:.0f} s: the distributed run does not match the single-process "
           "run")
    return EXIT_MISMATCH


def _measure(options: DemoOptions, settings: TrainSettings, out: Path, bars: EpochBars,
             traffic: dict) -> dict:
    """Everything the report says about the run, as data (the report's ``modes[mode]``)."""
    from .spirals import evaluate, load_flat_parameters

    world, mode = options.workers, settings.mode
    summary = json.loads((out / "summary.json").read_text())
    steps = checkpoint_steps(out)
    final = replica_states(out, mode, steps[-1], world)[0][0]
    if mode in ("ddp", "localsgd"):
        finals = [params for params, _ in rank_states(out, steps[-1], world)]
        identical = all(np.array_equal(finals[0], f) for f in finals[1:])
        holding = (f"all {world} hold identical final parameters" if identical
                   else "DIFFERENT final parameters on different ranks")
    else:
        identical = True
        holding = (f"each of the {world} holds 1/{world} of the parameters and momentum; the "
                   "shards merge into the full model" if mode == "fsdp" else
                   f"each of the {world} holds one stage of the model; the stages concatenate "
                   "into the full model")

    replay = SingleProcessRun(settings, world)
    worst, worst_at = 0.0, 0
    for begin, end in itertools.pairwise(steps):
        replay.load(replica_states(out, mode, begin, world))
        replay.run(begin, end)
        saved = [params for params, _ in replica_states(out, mode, end, world)]
        diff = max(float(np.max(np.abs(a - b)))
                   for a, b in zip(replay.parameters(), saved, strict=True))
        if diff >= worst:
            worst, worst_at = diff, end
    data = replay.data
    scratch, scratch_epochs, scratch_seconds = _from_scratch(settings, world, data)

    model = replay.models[0]
    load_flat_parameters(model, final)
    train_loss, train_acc, _ = evaluate(model, data.train)
    test_loss, test_acc, predicted = evaluate(model, data.test)
    _, scratch_acc, scratch_predicted = evaluate(scratch.models[0], data.test)
    samples, seconds, step_count = summary["samples"], summary["seconds"], summary["steps"]
    moved = traffic["bytes_in"] + traffic["bytes_out"]
    peers = [json.loads((out / f"peer-{r}.json").read_text()) for r in range(world)]
    peer_sent = sum(p["bytes_sent"] for p in peers)
    return {
        "job": f"demo-{mode}",
        "epochs": _epochs(bars),
        "result": {"test_accuracy": test_acc, "test_loss": test_loss,
                   "train_accuracy": train_acc, "train_loss": train_loss},
        "throughput": {
            "samples_per_second": samples / seconds, "steps_per_second": step_count / seconds,
            "steps": step_count, "samples": samples, "samples_per_step": samples // step_count,
            "seconds": seconds, "ranks": world,
            "single_process_samples_per_second": samples / scratch_seconds},
        "traffic": {
            "bytes_in": traffic["bytes_in"], "bytes_out": traffic["bytes_out"],
            "bytes_total": moved, "bytes_per_step_and_rank": moved / step_count / world,
            "generation": traffic["generation"],
            "collectives": {name: {"completed": n, "failed": failed}
                            for name, (n, failed) in sorted(traffic["ops"].items())},
            # Rank to rank, not through the hub: a pipeline's activations and gradients.
            "peer": {"bytes_sent": peer_sent,
                     "bytes_received": sum(p["bytes_received"] for p in peers),
                     "bytes_per_step": peer_sent / step_count}},
        "ranks": {"identical_final_parameters": identical, "summary": holding},
        "single_process": {
            "replay": {"check_every": CHECK_EVERY, "max_abs_difference": worst,
                       "after_step": worst_at, "tolerance": REPLAY_TOLERANCE,
                       "match": worst <= REPLAY_TOLERANCE},
            "from_scratch": {"test_accuracy": scratch_acc,
                             "prediction_agreement": float(np.mean(predicted == scratch_predicted)),
                             "epochs": scratch_epochs}},
        "match": identical and worst <= REPLAY_TOLERANCE,
    }


def _epochs(bars: EpochBars) -> list[dict]:
    """The reporting rank's epochs: mean training loss, test accuracy, seconds."""
    return [{k: e[k] for k in ("epoch", "loss", "test_accuracy", "seconds")}
            for e in bars.epoch_events]


def _from_scratch(settings: TrainSettings, world: int, data) -> tuple:
    """The same schedule trained in one process from the start, epoch by epoch: (the run, its
    loss and test accuracy per epoch, its training seconds without the evaluations)."""
    from .spirals import evaluate

    scratch = SingleProcessRun(settings, world)
    per_epoch = scratch.schedule.steps_per_epoch
    epochs, seconds = [], 0.0
    for epoch in range(settings.epochs):
        began = time.monotonic()
        losses = scratch.run(epoch * per_epoch, (epoch + 1) * per_epoch)
        seconds += time.monotonic() - began
        accuracy = evaluate(scratch.models[0], data.test)[1]
        epochs.append({"epoch": epoch + 1, "loss": float(np.mean(losses)),
                       "test_accuracy": accuracy})
    return scratch, epochs, seconds


def _print_report(run: dict, settings: TrainSettings, world: int) -> None:
    result, speed, traffic = run["result"], run["throughput"], run["traffic"]
    replay = run["single_process"]["replay"]
    scratch = run["single_process"]["from_scratch"]
    ops = ", ".join(f"{c['completed']:,} {name}" + (f" ({c['failed']} failed)" if c["failed"]
                                                     else "")
                    for name, c in traffic["collectives"].items())
    _print()
    _print("report")
    _print(f"  result       test accuracy {result['test_accuracy']:.1%}, test loss "
           f"{result['test_loss']:.4f}; train accuracy {result['train_accuracy']:.1%}, train "
           f"loss {result['train_loss']:.4f}")
    _print(f"  throughput   {speed['samples_per_second']:,.0f} samples/s, "
           f"{speed['steps_per_second']:.1f} steps/s ({speed['steps']:,} steps of "
           f"{speed['samples_per_step']:,} samples in {speed['seconds']:.1f} s on {world} ranks; "
           f"one process: {speed['single_process_samples_per_second']:,.0f} samples/s)")
    _print(f"  traffic      {_mb(traffic['bytes_total'])} through the hub: "
           f"{_mb(traffic['bytes_in'])} in, {_mb(traffic['bytes_out'])} out "
           f"({_kb(traffic['bytes_per_step_and_rank'])} per step and rank); Admin counters of "
           f"job '{run['job']}': {ops}")
    if traffic["peer"]["bytes_sent"]:
        _print(f"               {_mb(traffic['peer']['bytes_sent'])} rank to rank over peer "
               f"streams, not through the hub ({_kb(traffic['peer']['bytes_per_step'])} per "
               "step: activations forward and gradients back, and the evaluations' activations)")
    _print(f"  ranks        {run['ranks']['summary']}")
    _print(f"  vs 1 process each stretch of {CHECK_EVERY} steps replayed in one process from the "
           f"ranks' saved state: max |difference| {replay['max_abs_difference']:.1e} (after step "
           f"{replay['after_step']}; tolerance {REPLAY_TOLERANCE:.0e}) -> "
           f"{'MATCH' if replay['match'] else 'MISMATCH'}")
    _print(f"               trained from scratch in one process: test accuracy "
           f"{scratch['test_accuracy']:.1%}, predictions agree on "
           f"{scratch['prediction_agreement']:.1%} of test points")


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _kb(n: float) -> str:
    return f"{n / 1e3:,.1f} kB"

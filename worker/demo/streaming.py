"""``gradstar demo --mode streaming-diloco``: replicas that train alone and meet in Streaming
DiLoCo rounds on an embedded coordinator, then the global model's accuracy and the bytes.

Each replica (``python -m gradstar.worker.demo.streaming OUT INDEX``, settings in
``GRADSTAR_*`` and ``DEMO_*``) trains the spirals MLP on its own slice of the training set
with SGD and momentum, calls :class:`gradstar.StreamingDiLoCo` after every step, and writes its
bytes, rounds and epochs (mean loss and its own model's test accuracy) to OUT. The parent
evaluates the hub's global model on the test set, compares the bytes with what DDP would have
moved (every gradient, every step, both ways) and, with ``--report``/``--plot``, writes the
same as the other modes do (:mod:`.report`; the epochs are replica 0's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .spirals import evaluate, load_flat_parameters, make_model, make_spirals

#: Fragments of the MLP (its 6 parameter tensors: 3 layers of weight and bias).
FRAGMENTS = 3
#: Steps a round overlaps with training before it is merged, and the mixing factor.
DELAY, ALPHA = 1, 0.5


def _sdl_options(sync_every: int, workers: int) -> dict:
    # min_replicas=workers: a replica that starts first waits for the others instead of
    # training alone; a replica lost later stops the rounds (after round_timeout they fail).
    return dict(sync_every=sync_every, fragments=FRAGMENTS, delay=DELAY, alpha=ALPHA,
                outer_lr=0.7, outer_momentum=0.9, min_replicas=workers, round_timeout=10.0,
                timeout=120.0)


def run_streaming_demo(options) -> int:
    """Run the demo (``options``: a :class:`.command.DemoOptions`); return the exit code."""
    from gradstar.config import CoordinatorSettings
    from gradstar.coordinator import EmbeddedCoordinator
    from gradstar.coordinator.views import rounds_view

    from .report import plot_unavailable, report_data, write_artefacts

    problem = plot_unavailable() if options.plot is not None else None
    if problem is not None:
        print(f"gradstar demo: {problem}", file=sys.stderr)
        return 2
    sync_every = 4 * options.sync_every
    job = "demo-streaming-diloco"
    hub_settings = CoordinatorSettings(
        host="127.0.0.1", port=0, token=None, admin_token=None, tls_cert=None, tls_key=None,
        tls_client_ca=None, state_dir=None, metrics_port=None)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gradstar-demo-") as tmp, \
            EmbeddedCoordinator(hub_settings) as hub:
        print(f"gradstar demo: streaming-diloco on {options.workers} replica processes, "
              f"coordinator {hub.address} (embedded)\n  H={sync_every} steps, "
              f"{FRAGMENTS} fragments, tau={DELAY}, alpha={ALPHA}, outer Nesterov lr 0.7 "
              "momentum 0.9", flush=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSTAR_")}
        env.update(GRADSTAR_COORDINATOR=hub.address, GRADSTAR_JOB=job,
                   DEMO_WORKERS=str(options.workers), DEMO_EPOCHS=str(options.epochs),
                   DEMO_SAMPLES=str(options.samples), DEMO_BATCH=str(options.batch_size),
                   DEMO_HIDDEN=str(options.hidden), DEMO_LR=str(options.lr),
                   DEMO_SEED=str(options.seed), DEMO_SYNC_EVERY=str(sync_every))
        outs = [Path(tmp) / f"r{i}.json" for i in range(options.workers)]
        procs = [subprocess.Popen([sys.executable, "-m", "gradstar.worker.demo.streaming",
                                   str(out), str(i)], env=env) for i, out in enumerate(outs)]
        codes = [p.wait() for p in procs]
        if any(codes):
            message = f"replica exit codes {codes}"
            print(f"demo FAILED: {message}", file=sys.stderr)
            write_artefacts(options, report_data(options, time.monotonic() - began, 1, {
                "streaming-diloco": {"job": job, "epochs": _epochs(outs[0])}}, error=message))
            return 1
        results = [json.loads(out.read_text()) for out in outs]
        view = rounds_view(hub.coordinator.rounds, job)
    run = _measure(options, results, view, sync_every, job)
    _print_report(run, options.workers, time.monotonic() - began)
    exit_code = 0 if run["match"] else 1
    if not run["match"]:
        print("demo FAILED: the replicas ended with different global models", file=sys.stderr)
    written = write_artefacts(options, report_data(options, time.monotonic() - began, exit_code,
                                                   {"streaming-diloco": run}))
    if written is not None:
        return written
    if run["match"]:
        print("demo passed", flush=True)
    return exit_code


def _epochs(out: Path) -> list[dict]:
    """The epochs a replica got through, from its output (none if it wrote nothing)."""
    return json.loads(out.read_text())["epochs"] if out.exists() else []


def _measure(options, results: list[dict], view, sync_every: int, job: str) -> dict:
    """Everything the report says about the run, as data (the report's ``modes[mode]``)."""
    data = make_spirals(options.samples, seed=options.seed)
    model = make_model(data.features, data.classes, options.hidden, seed=options.seed)
    load_flat_parameters(model, np.asarray(results[0]["global"], dtype=np.float32))
    test_loss, test_acc, _ = evaluate(model, data.test)
    train_loss, train_acc, _ = evaluate(model, data.train)
    steps, world = results[0]["steps"], options.workers
    params = sum(p.numel() for p in model.parameters())
    sent = sum(r["bytes_sent"] for r in results)
    received = sum(r["bytes_received"] for r in results)
    exchanged = sent + received
    # DDP moves every gradient to the hub and the average back, every step, on every rank.
    ddp_bytes = 2 * 4 * params * steps * world
    seconds = max(r["seconds"] for r in results)
    samples = sum(r["samples"] for r in results)
    identical = all(r["global"] == results[0]["global"] for r in results)
    return {
        "job": job,
        # Replica 0's own model, epoch by epoch (the global model exists only at rounds).
        "epochs": results[0]["epochs"],
        "result": {"test_accuracy": test_acc, "test_loss": test_loss,
                   "train_accuracy": train_acc, "train_loss": train_loss},
        "throughput": {
            "samples_per_second": samples / seconds, "steps_per_second": steps / seconds,
            "steps": steps, "samples": samples, "samples_per_step": samples // steps,
            "seconds": seconds, "replicas": world},
        "traffic": {
            "bytes_sent": sent, "bytes_received": received, "bytes_total": exchanged,
            "bytes_per_step_and_replica": exchanged / steps / world,
            "ddp_bytes": ddp_bytes, "ddp_ratio": ddp_bytes / max(exchanged, 1),
            "parameters": params, "sync_every": sync_every, "fragments": FRAGMENTS,
            "rounds": {str(f.fragment): f.rounds for f in view.fragments},
            "last_round_replicas": len(view.fragments[0].last_participants)},
        "replicas": {"identical_global_model": identical,
                     "summary": f"all {world} hold the same global model" if identical else
                                "DIFFERENT global models on different replicas"},
        "match": identical,
    }


def _print_report(run: dict, world: int, seconds: float) -> None:
    result, traffic = run["result"], run["traffic"]
    print(f"  result: test accuracy {result['test_accuracy']:.3f} (loss "
          f"{result['test_loss']:.3f}) of the global model after {run['throughput']['steps']} "
          f"steps per replica, {seconds:.1f} s")
    print(f"  rounds: {', '.join(f'fragment {f}: {n}' for f, n in traffic['rounds'].items())}; "
          f"last round's replicas: {traffic['last_round_replicas']}")
    print(f"  bytes through the hub: {traffic['bytes_total']:,} ({traffic['bytes_sent']:,} sent, "
          f"{traffic['bytes_received']:,} received; DDP would move {traffic['ddp_bytes']:,}: "
          f"{traffic['ddp_ratio']:.0f}x more)")
    print(f"  replicas: {run['replicas']['summary']}", flush=True)


def _replica(out: Path, index: int) -> None:
    import torch

    import gradstar

    from .modes import MomentumSGD

    torch.set_num_threads(1)  # replicas share the host's cores with each other and the hub
    env = os.environ
    workers, epochs = int(env["DEMO_WORKERS"]), int(env["DEMO_EPOCHS"])
    batch, seed = int(env["DEMO_BATCH"]), int(env["DEMO_SEED"])
    data = make_spirals(int(env["DEMO_SAMPLES"]), seed=seed)
    x = torch.from_numpy(data.train.x[index::workers])
    y = torch.from_numpy(data.train.y[index::workers])
    model = make_model(data.features, data.classes, int(env["DEMO_HIDDEN"]), seed=seed)
    opt = MomentumSGD(model.parameters(), float(env["DEMO_LR"]), 0.9)
    steps_per_epoch = max(1, len(y) // batch)
    epochs_seen: list[dict] = []
    losses: list[float] = []
    trained = 0.0  # seconds of training, without the evaluations
    with gradstar.StreamingDiLoCo(model, replica=f"replica-{index}",
                                  **_sdl_options(int(env["DEMO_SYNC_EVERY"]), workers)) as sdl:
        total = epochs * steps_per_epoch
        began = time.monotonic()
        while sdl.local_steps < total:
            start = (sdl.local_steps % steps_per_epoch) * batch
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[start:start + batch]),
                                                     y[start:start + batch])
            loss.backward()
            opt.step()
            sdl.step()
            losses.append(loss.item())
            if sdl.local_steps % steps_per_epoch == 0:
                seconds = time.monotonic() - began
                trained += seconds
                epochs_seen.append({"epoch": len(epochs_seen) + 1,
                                    "loss": float(np.mean(losses)),
                                    "test_accuracy": evaluate(model, data.test)[1],
                                    "seconds": seconds})
                losses.clear()
                began = time.monotonic()
        sdl.finish()
        out.write_text(json.dumps({
            "steps": total, "samples": total * batch, "seconds": trained,
            "bytes_sent": sdl.client.bytes_sent, "bytes_received": sdl.client.bytes_received,
            "rounds": sdl.rounds, "epochs": epochs_seen,
            "global": sdl.global_parameters.tolist()}))


if __name__ == "__main__":
    _replica(Path(sys.argv[1]), int(sys.argv[2]))

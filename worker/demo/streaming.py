"""``gradstar demo --mode streaming-diloco``: replicas that train alone and meet in Streaming
DiLoCo rounds on an embedded coordinator, then the global model's accuracy and the bytes.

Each replica (``python -m gradstar.worker.demo.streaming OUT INDEX``, settings in
``GRADSTAR_*`` and ``DEMO_*``) trains the spirals MLP on its own slice of the training set
with SGD and momentum, calls :class:`gradstar.StreamingDiLoCo` after every step, and writes its
bytes and rounds to OUT. The parent evaluates the hub's global model on the test set and
compares the bytes with what DDP would have moved (every gradient, every step, both ways).
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

    if options.plot is not None or options.report is not None:
        print("gradstar demo: --plot and --report are not available with --mode "
              "streaming-diloco yet", file=sys.stderr)
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
            print(f"demo FAILED: replica exit codes {codes}", file=sys.stderr)
            return 1
        results = [json.loads(out.read_text()) for out in outs]
        view = rounds_view(hub.coordinator.rounds, job)
    data = make_spirals(options.samples, seed=options.seed)
    model = make_model(data.features, data.classes, options.hidden, seed=options.seed)
    load_flat_parameters(model, np.asarray(results[0]["global"], dtype=np.float32))
    test_loss, test_acc, _ = evaluate(model, data.test)
    steps = results[0]["steps"]
    params = sum(p.numel() for p in model.parameters())
    exchanged = sum(r["bytes"] for r in results)
    ddp_bytes = 2 * 4 * params * steps * options.workers
    print(f"  result: test accuracy {test_acc:.3f} (loss {test_loss:.3f}) of the global model "
          f"after {steps} steps per replica, {time.monotonic() - began:.1f} s")
    print(f"  rounds: {', '.join(f'fragment {f.fragment}: {f.rounds}' for f in view.fragments)};"
          f" last round's replicas: {len(view.fragments[0].last_participants)}")
    print(f"  bytes through the hub: {exchanged:,} (DDP would move {ddp_bytes:,}: "
          f"{ddp_bytes / max(exchanged, 1):.0f}x more)")
    if any(r["global"] != results[0]["global"] for r in results):
        print("demo FAILED: the replicas ended with different global models", file=sys.stderr)
        return 1
    print(f"  replicas: all {options.workers} hold the same global model\ndemo passed")
    return 0


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
    with gradstar.StreamingDiLoCo(model, replica=f"replica-{index}",
                                  **_sdl_options(int(env["DEMO_SYNC_EVERY"]), workers)) as sdl:
        total = epochs * steps_per_epoch
        while sdl.local_steps < total:
            start = (sdl.local_steps % steps_per_epoch) * batch
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[start:start + batch]),
                                                     y[start:start + batch])
            loss.backward()
            opt.step()
            sdl.step()
        sdl.finish()
        out.write_text(json.dumps({"steps": total, "bytes": sdl.bytes_exchanged,
                                   "rounds": sdl.rounds,
                                   "global": sdl.global_parameters.tolist()}))


if __name__ == "__main__":
    _replica(Path(sys.argv[1]), int(sys.argv[2]))

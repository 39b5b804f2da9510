"""A pipeline stage for tests: ``python pipeline_script.py [scenario ...]`` (settings from
GRADSTAR_* env vars; rank r runs stage r of a 4-stage MLP).

Runs the named scenarios of :data:`SCENARIOS` (default: all) in turn on one process group and
prints one JSON line per scenario (final parameters of the stage, losses, what the pipeline
measured). The scenario ``until_killed``, given last, trains until a step fails and reports the
error and when it came (the test kills a stage).

The model, data and steps are defined here once and imported by ``test_pipeline.py``, which
trains the unsplit model in one process with the same code as the reference.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import gradstar
from gradstar.errors import ConfigurationError, GradstarError

try:
    from .scenarios import run_scenario
except ImportError:  # run as a script
    from scenarios import run_scenario

SCRIPT = Path(__file__)
STAGES = 4
IN, HIDDEN, OUT = 5, 12, 3
STEPS = 5
LR = 0.1
M = 8
# Batch rows per step: 32 splits evenly into 8; the uneven runs change the batch every step
# (so activation shapes change between messages) and 8 never divides it.
EVEN = [32] * STEPS
UNEVEN = [30, 27, 33, 19, 30]


def make_model(seed: int = 0) -> nn.Sequential:
    """The whole model: a Sequential of STAGES stages; stage r is ``make_model()[r]``."""
    torch.manual_seed(seed)
    widths = [IN] + [HIDDEN] * (STAGES - 1) + [OUT]
    stages = []
    for r in range(STAGES):
        layers: list[nn.Module] = [nn.Linear(widths[r], widths[r + 1])]
        if r < STAGES - 1:
            layers.append(nn.Tanh())
        stages.append(nn.Sequential(*layers))
    return nn.Sequential(*stages)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1009 * step + rows)
    return torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)


def params_of(module: nn.Module) -> dict[str, list]:
    return {name: p.detach().double().reshape(-1).tolist()
            for name, p in module.named_parameters()}


def train_reference(sizes: list[int]) -> tuple[nn.Sequential, list[float]]:
    """One process, the unsplit model, the whole batch each step: what every run must equal."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step, rows in enumerate(sizes):
        x, y = batch(step, rows)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def train(pg, schedule: str, sizes: list[int], num_microbatches: int = M) -> dict:
    stage = make_model()[pg.rank]
    pipe = gradstar.Pipeline(stage, pg, num_microbatches=num_microbatches, schedule=schedule)
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    losses, live, peak_bytes = [], [], []
    for step, rows in enumerate(sizes):
        x, y = batch(step, rows)
        opt.zero_grad()
        loss = pipe.step(inputs=x if pipe.is_first else None,
                         targets=y if pipe.is_last else None,
                         loss_fn=nn.functional.mse_loss)
        opt.step()
        losses.append(None if loss is None else loss.item())
        live.append(pipe.max_live_activations)
        peak_bytes.append(pipe.peak_activation_bytes)
    return {"params": params_of(stage), "losses": losses, "max_live": live,
            "peak_bytes": peak_bytes, "actions": [str(a) for a in pipe.actions]}


def forward_backward(pg, schedule: str, sizes: list[int]) -> dict:
    """``train`` with ``pipe.forward`` / ``pipe.backward``: the last stage computes the loss of
    the whole batch's output itself and passes its gradient back."""
    stage = make_model()[pg.rank]
    pipe = gradstar.Pipeline(stage, pg, num_microbatches=M, schedule=schedule)
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    losses, live = [], []
    for step, rows in enumerate(sizes):
        x, y = batch(step, rows)
        opt.zero_grad()
        out = pipe.forward(x if pipe.is_first else None)
        if pipe.is_last:
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
            losses.append(loss.item())
            pipe.backward(out.grad)
        else:
            losses.append(None)
            pipe.backward()
        live.append([pipe.max_live_activations, pipe.live_activations])
        opt.step()
    return {"params": params_of(stage), "losses": losses, "live": live}


def inference(pg) -> dict:
    """pipe.forward of a 10-row batch in 3 micro-batches (3, 3, 4 rows): the last stage's
    output, and whether any gradient was left behind."""
    stage = make_model()[pg.rank]
    pipe = gradstar.Pipeline(stage, pg, num_microbatches=3, schedule="gpipe")
    x, _ = batch(99, 10)
    with torch.no_grad():
        out = pipe.forward(x if pipe.is_first else None)
    return {"out": None if out is None else out.tolist(),
            "grads_kept": any(p.grad is not None for p in stage.parameters())}


def send_recv(pg) -> dict:
    """Messages between processes: numpy and torch, several dtypes and shapes, reversed tags."""
    import ml_dtypes

    arrays = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "i64": np.array(7, dtype=np.int64),
        "bf16": torch.arange(6, dtype=torch.float32).to(torch.bfloat16).reshape(2, 3),
        "f16": torch.full((1, 2, 3), 0.5, dtype=torch.float16),
        "empty": np.empty((0, 5), dtype=np.float64),
        "bf16np": np.ones(4, dtype=ml_dtypes.bfloat16),
    }
    nxt, prev = (pg.rank + 1) % pg.world_size, (pg.rank - 1) % pg.world_size
    works = [pg.send(v, nxt, tag=("sr", name), async_op=True) for name, v in arrays.items()]
    got = {name: pg.recv(prev, tag=("sr", name)) for name in reversed(arrays)}
    for w in works:
        w.wait()
    checks = {}
    for name, sent in arrays.items():
        value = got[name]
        same_type = type(value) is type(sent)
        if isinstance(sent, torch.Tensor):
            equal = same_type and value.dtype == sent.dtype and torch.equal(value, sent)
        else:
            equal = same_type and value.dtype == sent.dtype and value.shape == sent.shape \
                and np.array_equal(value, sent)
        checks[name] = bool(equal)
    return {"checks": checks}


def misuse(pg) -> dict:
    """Calls each stage gets wrong, refused before anything is sent, then a correct step (which
    only works if the refused calls left the stages' call numbering in step)."""
    stage = make_model()[pg.rank]
    pipe = gradstar.Pipeline(stage, pg, num_microbatches=M, schedule="1f1b")
    x, y = batch(0, 32)
    small_x, small_y = batch(0, M - 1)
    wrong = [
        dict(inputs=None if pipe.is_first else x, targets=y if pipe.is_last else None),
        dict(inputs=x if pipe.is_first else None, targets=None if pipe.is_last else y),
        dict(inputs=small_x if pipe.is_first else x, targets=small_y if pipe.is_last else y),
    ]
    if pipe.is_first or pipe.is_last:  # a batch smaller than M, otherwise correct
        wrong.append(dict(inputs=small_x if pipe.is_first else None,
                          targets=small_y if pipe.is_last else None))
    messages = []
    for kwargs in wrong:
        try:
            pipe.step(loss_fn=nn.functional.mse_loss, **kwargs)
        except ConfigurationError as error:
            messages.append(str(error))
    loss = pipe.step(inputs=x if pipe.is_first else None, targets=y if pipe.is_last else None,
                     loss_fn=nn.functional.mse_loss)
    return {"messages": messages, "loss": None if loss is None else loss.item()}


SCENARIOS = {
    "gpipe": lambda pg: train(pg, "gpipe", EVEN),
    "1f1b": lambda pg: train(pg, "1f1b", EVEN),
    "gpipe_uneven": lambda pg: train(pg, "gpipe", UNEVEN),
    "1f1b_uneven": lambda pg: train(pg, "1f1b", UNEVEN),
    "1f1b_few": lambda pg: train(pg, "1f1b", EVEN, num_microbatches=2),
    "forward_backward": lambda pg: forward_backward(pg, "1f1b", EVEN),
    "forward_backward_uneven": lambda pg: forward_backward(pg, "gpipe", UNEVEN),
    "inference": inference,
    "send_recv": send_recv,
    "misuse": misuse,
}


class Slow(nn.Module):
    """Sleeps in every forward so that a step lasts long enough to be interrupted."""

    def forward(self, x):
        time.sleep(0.02)
        return x


def until_killed(pg) -> dict:
    """Train until a step fails (the test kills stage 2); report the error and when it came."""
    stage = nn.Sequential(make_model()[pg.rank], Slow())
    pipe = gradstar.Pipeline(stage, pg, num_microbatches=M, schedule="1f1b")
    steps = 0
    while True:
        x, y = batch(steps, 32)
        started = time.monotonic()
        try:
            pipe.step(inputs=x if pipe.is_first else None, targets=y if pipe.is_last else None,
                      loss_fn=nn.functional.mse_loss)
        except GradstarError as error:
            return {"rank": pg.rank, "steps": steps, "error": type(error).__name__,
                    "message": str(error), "lost_rank": getattr(error, "rank", None),
                    "seconds_in_failed_step": time.monotonic() - started,
                    "failed_at": time.time()}
        steps += 1
        print(json.dumps({"progress": steps}), flush=True)


def main() -> int:
    names = sys.argv[1:] or list(SCENARIOS)
    with gradstar.init_process_group(timeout=60, join_timeout=60) as pg:
        for name in names:
            if name == "until_killed":  # the last scenario: it ends when a stage is killed
                print(json.dumps({"scenario": name, **until_killed(pg)}), flush=True)
                return 0
            if not run_scenario(name, pg.rank, lambda f=SCENARIOS[name]: f(pg)):
                return 3
        pg.barrier()  # nobody leaves while a neighbour still waits for its last message
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

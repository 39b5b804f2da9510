"""One Streaming DiLoCo replica for the integration tests (a real process).

Usage: replica_script.py OUT_JSON (``{index}`` in it becomes the replica's index; settings
in GRADSTAR_* and SDL_* environment variables)

SDL_DEVICE (default cpu) is where the model lives. Waits for the file SDL_WAIT_FOR first, if
set (a late start without an import's delay).
Trains :func:`make_model` on its own stream of :func:`batch` data with plain SGD, calls
``StreamingDiLoCo.step()`` after each step, prints ``step N`` after each one (the tests watch
for these), and writes what it ended with to OUT_JSON. The tests' single-process reference
imports the model, the data and the inner step from here, so both run the same code.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import gradstar

IN, HIDDEN, OUT = 6, 12, 3
INNER_LR = 0.05


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT))


def batch(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``index``'s batch at inner step ``step`` (its own data, the same every run)."""
    g = torch.Generator().manual_seed(1000 * index + step)
    x = torch.randn(16, IN, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(IN, OUT, generator=teacher)
    return x, torch.tanh(x @ w)


def inner_step(model: torch.nn.Module, index: int, step: int) -> None:
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in batch(index, step))
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= INNER_LR * p.grad


def options() -> dict:
    env = os.environ
    return dict(sync_every=int(env["SDL_H"]), fragments=int(env["SDL_P"]),
                delay=int(env["SDL_TAU"]), alpha=float(env["SDL_ALPHA"]),
                min_replicas=int(env["SDL_MIN_REPLICAS"]),
                round_timeout=float(env["SDL_ROUND_TIMEOUT"]), timeout=60.0,
                outer_lr=0.7, outer_momentum=0.9, replica=env.get("SDL_REPLICA"))


def main() -> None:
    # Under the agent: the index is the rank, and the replica is named after it.
    index = int(os.environ.get("SDL_INDEX") or os.environ["GRADSTAR_RANK"])
    out = sys.argv[1].format(index=index)
    steps, pause = int(os.environ["SDL_STEPS"]), float(os.environ.get("SDL_SLEEP", "0"))
    # SDL_LEAVE_AT: leave the rounds for good (StreamingDiLoCo.leave) after running that many
    # steps of its own; SDL_LEAVE_WHEN: leave at the first step at which that file exists.
    leave_at = int(os.environ.get("SDL_LEAVE_AT", "-1"))
    leave_when = os.environ.get("SDL_LEAVE_WHEN")
    torch.set_num_threads(1)  # replicas share the machine's cores
    model = make_model().to(os.environ.get("SDL_DEVICE", "cpu"))
    gate = os.environ.get("SDL_WAIT_FOR")
    while gate and not os.path.exists(gate):  # torch is imported: join the moment it appears
        time.sleep(0.01)
    with gradstar.StreamingDiLoCo(model, **options()) as sdl:
        print(f"joined {sdl.joined_at_step} {sdl.rounds} pid {os.getpid()} in "
              f"{sdl.join_seconds:.3f} s", flush=True)
        left, ran = False, 0
        while sdl.local_steps < steps:
            if ran == leave_at or (leave_when and os.path.exists(leave_when)):
                sdl.leave()
                left = True
                break
            inner_step(model, index, sdl.local_steps)
            sdl.step()
            ran += 1
            print(f"step {sdl.local_steps}", flush=True)
            time.sleep(pause)
        if not left:
            sdl.finish()
        result = {"left": left, "replica": sdl.replica, "rounds": sdl.rounds,
                  "late": sdl.late_rounds, "joined_at": sdl.joined_at_step,
                  "global": sdl.global_parameters.tolist(),
                  "device": str(next(model.parameters()).device),
                  "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                  .cpu().tolist()}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

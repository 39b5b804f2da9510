"""Pipeline schedules: the order in which one stage runs its micro-batches' forward and
backward passes in a training step. Pure functions, no torch and no I/O.

With ``S`` stages and ``M`` micro-batches, stage ``s`` runs ``F(i)`` (forward of micro-batch
``i``: receive its activation from stage s-1 unless first, run the stage, send the output to
stage s+1 unless last) and ``B(i)`` (receive the gradient of that output from stage s+1 unless
last, backpropagate, send the gradient of the stage's input to stage s-1 unless first) once
each, forwards in order 0..M-1 and backwards in order 0..M-1.

* **GPipe**: ``F(0) .. F(M-1)``, then ``B(0) .. B(M-1)``. Every micro-batch's activations are
  alive at once: M on every stage.
* **1F1B** (PipeDream-flush): a warm-up of ``min(S - s - 1, M)`` forwards, then one forward and
  one backward alternately, then the remaining backwards. At most ``min(S - s, M)``
  micro-batches' activations are alive on stage s, independent of M, and the step takes as
  long as GPipe's: :func:`simulate` shows both finish in ``2 * (M + S - 1)`` unit-time slots.

The executor (:class:`gradstar.client.pipeline.pipeline.Pipeline`) sends asynchronously and receives
with a look-ahead, so only these dependencies constrain it, and :func:`simulate` proves the
schedules are free of deadlock under them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gradstar.errors import ConfigurationError

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True, order=True)
class Action:
    """One step of a stage's schedule: ``kind`` "F" (forward) or "B" (backward) of ``micro``."""

    kind: str
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def _check(stages: int, stage: int, num_microbatches: int) -> None:
    if stages < 1 or not 0 <= stage < stages:
        raise ConfigurationError(f"stage {stage} is out of range for {stages} stages")
    if num_microbatches < 1:
        raise ConfigurationError(f"num_microbatches must be at least 1, got {num_microbatches}")


def gpipe(stages: int, stage: int, num_microbatches: int) -> list[Action]:
    """All forwards, then all backwards."""
    _check(stages, stage, num_microbatches)
    m = range(num_microbatches)
    return [Action(FORWARD, i) for i in m] + [Action(BACKWARD, i) for i in m]


def warmup_forwards(stages: int, stage: int, num_microbatches: int) -> int:
    """How many forwards stage ``stage`` runs under 1F1B before its first backward."""
    return min(stages - stage - 1, num_microbatches)


def one_f_one_b(stages: int, stage: int, num_microbatches: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward and one backward, then drain backwards."""
    _check(stages, stage, num_microbatches)
    warmup = warmup_forwards(stages, stage, num_microbatches)
    actions = [Action(FORWARD, i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        actions += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
    actions += [Action(BACKWARD, i) for i in range(num_microbatches - warmup, num_microbatches)]
    return actions


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def schedule_actions(schedule: str, stages: int, stage: int,
                     num_microbatches: int) -> list[Action]:
    """The action list of ``schedule`` ("gpipe" or "1f1b") for one stage.

    Raises:
        ConfigurationError: unknown schedule, stage out of range, or no micro-batches.
    """
    try:
        build = SCHEDULES[schedule]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}"
        ) from None
    return build(stages, stage, num_microbatches)


def peak_live(actions: Sequence[Action]) -> int:
    """The most micro-batches forwarded and not yet backwarded at any point of ``actions``."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def split_sizes(batch: int, num_microbatches: int) -> list[int]:
    """Micro-batch sizes along dim 0: equal, the last one taking the remainder.

    Raises:
        ConfigurationError: ``batch`` is smaller than ``num_microbatches``.
    """
    if batch < num_microbatches:
        raise ConfigurationError(
            f"a batch of {batch} rows cannot be split into {num_microbatches} micro-batches; "
            f"pass at least {num_microbatches} rows or lower num_microbatches"
        )
    base = batch // num_microbatches
    return [base] * (num_microbatches - 1) + [batch - base * (num_microbatches - 1)]


def simulate(per_stage: Sequence[Sequence[Action]]) -> int:
    """Run every stage's action list in unit-time slots under the pipeline's dependencies and
    return how many slots the step takes.

    In each slot every stage runs its next action if its inputs exist: ``F(i)`` on stage s
    needs ``F(i)`` done on stage s-1; ``B(i)`` needs ``F(i)`` done on the same stage and
    ``B(i)`` done on stage s+1. Results of a slot are visible from the next slot on.

    Raises:
        ValueError: no stage can move although some have actions left (a deadlock).
    """
    stages = len(per_stage)
    done: set[tuple[int, str, int]] = set()
    cursor = [0] * stages
    slots = 0
    while any(c < len(a) for c, a in zip(cursor, per_stage, strict=True)):
        ready = []
        for s, actions in enumerate(per_stage):
            if cursor[s] == len(actions):
                continue
            a = actions[cursor[s]]
            if a.kind == FORWARD:
                ok = s == 0 or (s - 1, FORWARD, a.micro) in done
            else:
                ok = (s, FORWARD, a.micro) in done and (
                    s == stages - 1 or (s + 1, BACKWARD, a.micro) in done)
            if ok:
                ready.append((s, a))
        if not ready:
            stuck = {s: str(a[c]) for s, (c, a) in enumerate(zip(cursor, per_stage, strict=True))
                     if c < len(a)}
            raise ValueError(f"deadlock after {slots} slots; next actions: {stuck}")
        for s, a in ready:
            done.add((s, a.kind, a.micro))
            cursor[s] += 1
        slots += 1
    return slots

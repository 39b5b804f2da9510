"""How long a sync-mode step waits for its ranks: the adaptive waits of
:mod:`gradstar.sync_modes`, measured on the hub's record of the recent steps' fresh arrivals
(:class:`Arrivals`, one per closed step). No I/O, no clock: the ledger passes the record."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ADAPT_STEPS", "CARRY_QUANTILE", "Arrivals", "adaptive_wait", "worth_waiting"]

#: Closed steps whose arrivals an adaptive timeout is measured on.
ADAPT_STEPS = 16
#: The quantile of those steps' spreads that Asynchronous and BoundedStaleness wait twice (a
#: gradient they miss is stale, not dropped, but one missed step puts that rank out of
#: phase: measured on 4 ranks without a straggler, the median left 14% of the steps partial).
CARRY_QUANTILE = 0.9


def adaptive_wait(recent: Sequence[Sequence[float]], k: int,
                  quantile: float = 0.5) -> float | None:
    """Twice the ``quantile`` (the median by default), over the last :data:`ADAPT_STEPS` of
    the ``recent`` steps' fresh arrivals that held ``k`` of them, of the seconds from their
    first fresh contribution to their ``k``-th (None: no step has shown it yet)."""
    spreads = sorted(arrivals[k - 1] for arrivals in list(recent)[-ADAPT_STEPS:]
                     if len(arrivals) >= k)
    return 2 * spreads[min(len(spreads) - 1, int(quantile * len(spreads)))] if spreads else None


class Arrivals(tuple):
    """One closed step's fresh arrivals: the seconds from its first fresh gradient to each
    fresh one, in arrival order (the tuple), and ``ready``: the seconds from the close of the
    step before it to that first fresh gradient (None: not measured, as for a ledger's first
    step)."""

    ready: float | None

    def __new__(cls, offsets: Sequence[float] = (), ready: float | None = None) -> Arrivals:
        self = super().__new__(cls, offsets)
        self.ready = ready
        return self


def worth_waiting(recent: Sequence[Sequence[float]], k: int) -> float | None:
    """The longest wait after a step's first fresh gradient for which waiting for one more
    gradient, past the ``k``-th, still pays (None: not measured yet): the median time to the
    ``k``-th plus the median *cycle* (a step's close to the next one's ``k``-th fresh
    gradient, ``Arrivals.ready`` plus that time) over ``k``. Waiting ``L`` past the ``k``-th
    gradient for a ``k + 1``-th makes ``k + 1`` gradients in a cycle plus ``L`` where not
    waiting makes ``k`` in a cycle: it pays while ``L`` < cycle / ``k``. A late gradient is
    carried into the next step, not lost."""
    steps = [(a[k - 1], a.ready + a[k - 1]) for a in list(recent)[-ADAPT_STEPS:]
             if len(a) >= k and getattr(a, "ready", None) is not None]
    if not steps:
        return None
    spread, cycle = zip(*steps, strict=True)
    return _median(spread) + _median(cycle) / k


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]

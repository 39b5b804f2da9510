"""A large all_reduce as several collectives in flight at once, so that it can use several TCP
connections to each target.

One collective travels on one stream per target, and so on one TCP connection per target,
whose window caps it at that window per round trip (:mod:`gradstar.client.collective.connections`).
An all_reduce of at least ``split_bytes`` (:class:`gradstar.config.ClientSettings`, default
:data:`SPLIT_BYTES`) is therefore cut into up to :data:`MAX_PARTS`
contiguous parts of at least :data:`PART_BYTES`, each an all_reduce of its own (its seq taken
at the call, in order, as every rank does from the same size), all issued at once: collective
seq ``s`` rides connection ``s % connections`` of each target
(:class:`gradstar.client.collective.targets.Target`), so far targets carry the parts on as
many connections, near ones on their one. The result is the same elementwise reduction of the
same inputs: each element is reduced by exactly one part, as it would be by the whole.

Every rank cuts the same parts from the same shape and dtype, so the parts pair up on the hub
whatever round trip each rank measured. A part that fails fails the call with its error; the
other parts are cancelled, which fails them on every rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from gradstar import ops

from ..collective.stream import issue
from ..convert import delivered

#: All_reduces from this many bytes are split; each part is at least PART_BYTES.
SPLIT_BYTES = 32 << 20
PART_BYTES = 16 << 20
MAX_PARTS = 4
#: Parts start at multiples of this many bytes.
_ALIGN = 64 << 10


def part_bounds(size: int, itemsize: int, split_bytes: int = SPLIT_BYTES,
                ) -> list[tuple[int, int]]:
    """The parts of an all_reduce of ``size`` elements of ``itemsize`` bytes, as element
    ranges [start, stop) in order; empty where it is not split (under ``split_bytes``, or
    ``split_bytes`` 0)."""
    nbytes = size * itemsize
    parts = min(MAX_PARTS, nbytes // PART_BYTES)
    if split_bytes <= 0 or nbytes < split_bytes or parts < 2:
        return []
    align = max(1, _ALIGN // itemsize)
    step = -(-size // parts // align) * align
    starts = list(range(0, size, step))
    return [(a, min(a + step, size)) for a in starts]


def split_all_reduce(group, arr: np.ndarray, reduce_op: int, into: np.ndarray,
                     restore: Callable[[np.ndarray], object], timeout: float | None,
                     wire: str | None) -> Awaitable | None:
    """``group``'s all_reduce of ``arr`` into ``into`` as parts (see the module), resolving
    to ``restore(into)``; None where ``arr`` is not split (too small, or not C-contiguous).
    Every part's seq is taken now."""
    bounds = part_bounds(arr.size, arr.itemsize, group.settings.split_bytes)
    if not bounds or not (arr.flags.c_contiguous and into.flags.c_contiguous):
        return None
    send, out = arr.reshape(-1), into.reshape(-1)
    # Chunks as large as the whole's: a part cut into smaller ones costs more messages.
    reserved = [group.reserve(ops.ALL_REDUCE, send[a:b], reduce_op=reduce_op, timeout=timeout,
                              wire=wire, part_of=arr.nbytes) for a, b in bounds]

    async def run():
        parts = [group.run_reserved(r, send[a:b], out[a:b])
                 for r, (a, b) in zip(reserved, bounds, strict=True)]
        try:
            await asyncio.wait(parts, return_when=asyncio.FIRST_EXCEPTION)
            for part in parts:
                if part.done() and not part.cancelled() and part.exception() is not None:
                    raise part.exception()
        finally:
            for part in parts:
                part.cancel()
            await asyncio.gather(*parts, return_exceptions=True)
        return await delivered(restore, into)

    async def abandon():
        for r in reserved:
            group.give_up(r)

    return issue(run, abandon)


__all__ = ["MAX_PARTS", "PART_BYTES", "SPLIT_BYTES", "part_bounds", "split_all_reduce"]

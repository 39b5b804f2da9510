"""BucketPlan: which tensors travel together in one flat all_reduce, and where each one sits.

Pure bookkeeping, no torch and no sockets (and so is a backward pass's :class:`SyncStep`):
:class:`~gradstar.client.ddp.DistributedDataParallel` uses it for gradient buckets and
:func:`~gradstar.client.coalesced.all_reduce_coalesced` for arbitrary arrays, and
``tests/unit/test_buckets.py`` drives it directly.

The assignment follows torch's ``compute_bucket_assignment_by_size``:

* Tensors are taken in **reverse** registration order (``reverse=True``, DDP's default), since
  backward produces gradients roughly from the last layer to the first, so the first bucket
  fills up, and can be sent, first.
* Tensors of different dtypes never share a bucket (a bucket is one flat array); each dtype has
  its own open bucket while the tensors are walked.
* A bucket holds at most ``cap_bytes``: a tensor that would push its dtype's open bucket over
  the cap closes that bucket and starts the next one. (torch instead closes a bucket once it
  *reaches* the cap, so its buckets overshoot by up to one tensor; here the cap is a bound.) A
  tensor larger than the cap on its own gets a bucket to itself.
* Buckets are numbered in the order of their first tensor in the walk, so bucket 0 holds the
  tensors backward produces first. All ranks compute the same plan from the same tensors, which
  is what lets them issue the buckets' collectives in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from gradstar.errors import ConfigurationError

MiB = 1 << 20


class TensorSpec(NamedTuple):
    """What the plan needs to know about one tensor."""

    numel: int
    itemsize: int
    dtype: Hashable  # grouping key: tensors with equal keys may share a bucket


@dataclass(frozen=True)
class Bucket:
    """One flat array: ``members[k]`` (a tensor index) occupies elements
    ``offsets[k] : offsets[k] + numels[k]``."""

    index: int
    dtype: Hashable
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int
    nbytes: int


class BucketPlan:
    """The buckets of a list of tensors under a byte cap; see the module docstring for the rules.

    Raises:
        ConfigurationError: ``cap_bytes`` is not positive, or a spec has a negative size.
    """

    def __init__(self, specs: Sequence[TensorSpec], cap_bytes: int, *, reverse: bool = True):
        if cap_bytes <= 0:
            raise ConfigurationError(f"the bucket cap must be positive, got {cap_bytes} bytes")
        self.cap_bytes = cap_bytes
        self.specs = [TensorSpec(*s) for s in specs]
        for i, spec in enumerate(self.specs):
            if spec.numel < 0 or spec.itemsize <= 0:
                raise ConfigurationError(f"tensor {i} has an invalid size: {spec}")
        order = range(len(self.specs) - 1, -1, -1) if reverse else range(len(self.specs))

        closed: list[list[int]] = []
        open_by_dtype: dict[Hashable, list[int]] = {}
        open_bytes: dict[Hashable, int] = {}
        for i in order:
            spec = self.specs[i]
            size = spec.numel * spec.itemsize
            current = open_by_dtype.get(spec.dtype)
            if current and open_bytes[spec.dtype] + size > self.cap_bytes:
                closed.append(current)
                current = None
            if current is None:
                current = open_by_dtype[spec.dtype] = []
                open_bytes[spec.dtype] = 0
            current.append(i)
            open_bytes[spec.dtype] += size
        closed.extend(b for b in open_by_dtype.values() if b)

        position = {i: k for k, i in enumerate(order)}
        closed.sort(key=lambda members: position[members[0]])
        self.buckets: list[Bucket] = [self._bucket(n, m) for n, m in enumerate(closed)]
        # tensor index -> (bucket index, position in the bucket)
        self.location: dict[int, tuple[int, int]] = {
            i: (b.index, k) for b in self.buckets for k, i in enumerate(b.members)
        }

    def _bucket(self, index: int, members: list[int]) -> Bucket:
        numels = tuple(self.specs[i].numel for i in members)
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += n
        first = self.specs[members[0]]
        return Bucket(index=index, dtype=first.dtype, members=tuple(members),
                      offsets=tuple(offsets), numels=numels, numel=total,
                      nbytes=total * first.itemsize)

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def __getitem__(self, index: int) -> Bucket:
        return self.buckets[index]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{len(b.members)}x{b.dtype}:{b.nbytes}B" for b in self.buckets)
        return f"BucketPlan(cap_bytes={self.cap_bytes}, buckets=[{sizes}])"


def cap_bytes_of(bucket_cap_mb: float) -> int:
    """``bucket_cap_mb`` in bytes (MB = 2**20 bytes, as in torch); at least one byte.

    Raises:
        ConfigurationError: ``bucket_cap_mb`` is not a positive number.
    """
    try:
        ok = bucket_cap_mb > 0
    except TypeError:
        ok = False
    if not ok or isinstance(bucket_cap_mb, bool):
        raise ConfigurationError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
    return max(1, int(bucket_cap_mb * MiB))


@dataclass
class BucketLaunch:
    """One bucket's all_reduce starting: ``during`` is "backward" (from a gradient hook),
    "end of backward" (from the engine callback) or "sync_gradients"."""

    bucket: int
    at: float
    during: str


@dataclass
class StepTimeline:
    """What happened in one gradient synchronisation, in ``time.perf_counter()`` seconds.

    For inspection and tests of overlap: compare the *order* of events, not their durations.
    """

    started: float
    hooks: list[tuple[str, float]] = field(default_factory=list)  # (param name, ready at)
    launches: list[BucketLaunch] = field(default_factory=list)
    backward_end: float | None = None  # the engine's end-of-backward callback began
    finished: float | None = None  # every gradient holds the mean

    @property
    def launched_during_backward(self) -> int:
        """How many buckets started from a gradient hook, before backward ended."""
        return sum(launch.during == "backward" for launch in self.launches)


class SyncStep:
    """DDP's bookkeeping of one synchronisation: which parameters are ready, which buckets are
    out."""

    def __init__(self, n_params: int, plan: BucketPlan) -> None:
        self.ready = [False] * n_params
        self.pending = [len(b.members) for b in plan]
        self.next_launch = 0
        self.works: list = [None] * len(plan)
        self.control_work = None  # the step's control values: bucket caps, used-parameter flags
        self.weight_work = None  # the sum of the ranks' weights, when weighted
        self.unexpected: list[int] = []  # static_graph: hooks of parameters unused at step one
        self.timeline = StepTimeline(started=time.perf_counter())


__all__ = ["Bucket", "BucketLaunch", "BucketPlan", "StepTimeline", "SyncStep", "TensorSpec",
           "cap_bytes_of"]

"""Streaming DiLoCo's plan, without torch or I/O: which parameters form each fragment, and at
which inner steps each fragment's outer round starts and merges.

Fragments are contiguous runs of the module's parameters (in ``module.parameters()`` order,
so consecutive layers stay together) with about equal element counts. Fragment ``p`` of ``P``
has offset ``p * H // P`` and starts a round after every inner step ``t >= 1`` with
``(t - offset_p) % H == 0`` (fragment 0 first at ``H``); the round's result is merged
``delay`` (tau) steps later. With the
offsets spread over ``H``, at most one or two fragments are in flight at any step, so a
replica's peak upload is about 1/P of plain DiLoCo's.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradstar.errors import ConfigurationError


def split_fragments(sizes: list[int], fragments: int) -> list[range]:
    """Cut parameters of ``sizes`` elements into ``fragments`` contiguous runs of about equal
    total size; each run is a range of parameter indices, none empty.

    Raises:
        ConfigurationError: ``fragments`` is not between 1 and the number of parameters.
    """
    if not 1 <= fragments <= len(sizes):
        raise ConfigurationError(
            f"fragments must be between 1 and the module's {len(sizes)} parameter tensors, "
            f"got {fragments}")
    total = sum(sizes)
    runs, start, seen = [], 0, 0
    for p in range(1, fragments):
        # End this run where the running total first reaches p/P of the whole, leaving at
        # least one parameter for every later run.
        target = total * p / fragments
        end = start + 1
        seen += sizes[start]
        while end < len(sizes) - (fragments - p) and seen + sizes[end] / 2 <= target:
            seen += sizes[end]
            end += 1
        runs.append(range(start, end))
        start = end
    runs.append(range(start, len(sizes)))
    return runs


@dataclass(frozen=True)
class Schedule:
    """When each fragment syncs: period ``sync_every`` (H), ``fragments`` (P), ``delay`` (tau).

    Raises (at construction):
        ConfigurationError: H < 1, P < 1, or tau not in [0, H).
    """

    sync_every: int
    fragments: int
    delay: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ConfigurationError(f"sync_every must be a positive integer, got "
                                     f"{self.sync_every!r}")
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ConfigurationError(f"fragments must be a positive integer, got "
                                     f"{self.fragments!r}")
        if not isinstance(self.delay, int) or not 0 <= self.delay < self.sync_every:
            raise ConfigurationError(
                f"delay (tau) must be an integer in [0, sync_every={self.sync_every}), got "
                f"{self.delay!r}: a fragment's round must merge before its next one starts")

    def offset(self, fragment: int) -> int:
        return fragment * self.sync_every // self.fragments

    def first(self, fragment: int) -> int:
        """The step after which ``fragment``'s round 0 starts (never step 0)."""
        return self.offset(fragment) or self.sync_every

    def starts(self, step: int) -> list[int]:
        """Fragments whose round starts after inner step ``step`` (counted from 1)."""
        return [p for p in range(self.fragments)
                if step >= self.first(p) and (step - self.first(p)) % self.sync_every == 0]

    def resume_step(self, rounds: list[int]) -> int:
        """The step a replica joining with fragments at ``rounds`` completed rounds takes up:
        where the latest of those rounds started on the replicas that ran it (0 if none ran)."""
        return max((self.first(p) + (r - 1) * self.sync_every for p, r in enumerate(rounds)
                    if r), default=0)

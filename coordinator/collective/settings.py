"""The collective engine a hub process runs, built from its settings (the coordinator's and a hub
shard's alike)."""

from __future__ import annotations

from ..rendezvous.rendezvous import Rendezvous
from .budget import CollectiveBudget
from .engine import CollectiveEngine


def engine_from_settings(rendezvous: Rendezvous, settings, *, averaging=None,
                         metrics=None) -> CollectiveEngine:
    """An engine whose limits, budget and arrival measurement are as ``settings`` (a
    :class:`~gradstar.config.CoordinatorSettings` or :class:`~gradstar.config.ShardSettings`)
    say; ``averaging`` and ``metrics`` as :class:`CollectiveEngine` takes them."""
    s = settings
    engine = CollectiveEngine(
        rendezvous, max_tensor_bytes=s.max_tensor_bytes, max_chunk_bytes=s.max_chunk_bytes,
        max_timeout=s.max_collective_timeout, averaging=averaging, metrics=metrics,
        budget=CollectiveBudget(s.max_collective_state_bytes, s.max_pending_per_member,
                                s.max_pending_per_job, s.collective_state_job_share))
    engine.metrics.arrivals.enabled = s.measure_arrivals
    return engine


__all__ = ["engine_from_settings"]

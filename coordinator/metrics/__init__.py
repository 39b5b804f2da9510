"""What the coordinator measures and serves on ``/metrics``: :mod:`.prometheus` (the collective
engine's observations and the Prometheus page) and :mod:`.arrivals` (each rank's arrival lag
per job, in bounded summaries, wherever collectives run; what the stragglers views read).
"""

from .arrivals import ArrivalBook, RankArrivals
from .prometheus import (
    METRICS_MAX_BYTES,
    RANKS_NAMED,
    CollectiveMetrics,
    Histogram,
    job_arrivals,
    render,
    render_async,
)

__all__ = [
    "METRICS_MAX_BYTES",
    "RANKS_NAMED",
    "ArrivalBook",
    "CollectiveMetrics",
    "Histogram",
    "RankArrivals",
    "job_arrivals",
    "render",
    "render_async",
]

"""What operators see of the hub: the Admin service and the status page.

:mod:`.admin` is the gRPC Admin service (jobs, shards, rounds, draining; ``gradstar admin``),
:mod:`.status` the status page's data (jobs, straggler lag, traffic rates, recent failures,
shards; no I/O) and :mod:`.page` its HTML and JSON. The Prometheus page is
:mod:`gradstar.coordinator.metrics`, beside the engine that observes into it.
"""

from .admin import PAGE_SIZE, AdminServicer, rounds_view
from .page import render_html, render_json, status_routes
from .status import CoordinatorStatus, FailureLog, TrafficRates

__all__ = [
    "PAGE_SIZE",
    "AdminServicer",
    "CoordinatorStatus",
    "FailureLog",
    "TrafficRates",
    "render_html",
    "render_json",
    "rounds_view",
    "status_routes",
]

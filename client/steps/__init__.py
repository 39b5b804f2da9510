"""The rank's side of DDP sync modes: the Steps client and the contribute / catch-up driver
(the hub's side is ``gradstar.coordinator.steps``)."""

from .client import Aggregates, StepsClient

__all__ = ["Aggregates", "StepsClient"]

"""The hub's side of DDP sync modes: the step ledger and its Steps servicer (the rank's side is
``gradstar.client.steps``)."""

from .ledger import StepLedger
from .servicer import StepsServicer
from .store import SnapshotStore
from .table import StepsTable

__all__ = ["SnapshotStore", "StepLedger", "StepsServicer", "StepsTable"]

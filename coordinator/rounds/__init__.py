"""Fault-tolerant outer rounds and the global models they train.

:mod:`.table` is the rounds state machine (fragments, replicas, round closing; no I/O),
:mod:`.averaging` the store of each job's global model (averaging rounds, outer optimizer steps,
persistence) and :mod:`.servicer` the gRPC Rounds service that drives the table. The replica's
half is :mod:`gradstar.client.outer.rounds`.
"""

from .averaging import AveragingRound, AveragingStore, GlobalModel, state_file_stem
from .servicer import RoundsServicer
from .table import Policy, RoundsTable

__all__ = [
    "AveragingRound",
    "AveragingStore",
    "GlobalModel",
    "Policy",
    "RoundsServicer",
    "RoundsTable",
    "state_file_stem",
]

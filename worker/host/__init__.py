"""The host side of a job: start, watch, restart and stop a host's rank processes.

:mod:`.supervisor` is the core (the rank processes, their output and exit), :mod:`.launch`
``gradstar launch`` (N ranks on this machine, like ``torchrun``) and :mod:`.agent`
``gradstar worker`` (the per-host agent that restarts ranks and reports health).
"""

from .agent import AgentSettings, WorkerAgent, run_agent
from .launch import LaunchOptions, run_launch, script_command
from .supervisor import Outcome, RankStatus, RankSupervisor, rank_env, run_with_signals

__all__ = [
    "AgentSettings",
    "LaunchOptions",
    "Outcome",
    "RankStatus",
    "RankSupervisor",
    "WorkerAgent",
    "rank_env",
    "run_agent",
    "run_launch",
    "run_with_signals",
    "script_command",
]

"""How the scenario scripts of these tests run their scenarios in one process group: each
scenario's result printed as one JSON line (``scenario``, ``rank``, its fields), or, where it
raised a gradstar error, ``fatal`` (the error's class) and ``message``, after which the script
stops (exit status 3) and the test reads the line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import gradstar
from gradstar.errors import GradstarError


def run_scenario(name: str, rank: int, call: Callable[[], dict], **fields) -> bool:
    """Run one scenario and print its line (``fields`` added to it); False if it failed."""
    try:
        result = call()
    except GradstarError as error:
        result = {"fatal": type(error).__name__, "message": str(error)}
    print(json.dumps({"scenario": name, "rank": rank, **fields, **result}), flush=True)
    return "fatal" not in result


def run_scenarios(scenarios: dict[str, Callable], names: Iterable[str], timeout: float = 30,
                  ) -> int:
    """Join the job (``init_process_group`` as the tests configure it) and run ``names`` of
    ``scenarios`` (each called with the group) in order; the exit status."""
    with gradstar.init_process_group(timeout=timeout, join_timeout=60) as pg:
        for name in names:
            if not run_scenario(name, pg.rank, lambda f=scenarios[name]: f(pg)):
                return 3
        pg.barrier()  # nobody leaves while a peer is still in its last collective
    return 0

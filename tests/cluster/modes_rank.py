"""A rank of the emulated cluster's elastic sync-mode test: ``tests/parallel/sync_modes_script.py``
(a DDP in a sync mode), started by ``gradstar worker`` on a host (host N's rank asks for rank
N) or by the test itself as a joiner (GRADSTAR_ELASTIC, no rank): ``python -m
tests.cluster.modes_rank OUT NAME -- SCRIPT_ARGS...``. What the script prints goes to
``OUT/modes-NAME.json`` with its exit code (NAME: the host's rank, or ``joiner``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

from tests.cluster.report import write_report
from tests.parallel import sync_modes_script


def main() -> int:
    out, name, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if name != "joiner":
        os.environ["GRADSTAR_RANK"] = os.environ["CLUSTER_HOST"].removeprefix("host")
    printed = io.StringIO()
    sys.argv = [str(sync_modes_script.SCRIPT), *rest]
    code = 0
    with contextlib.redirect_stdout(printed):
        try:
            sync_modes_script.main()
        except BaseException as error:
            code = 1
            print(json.dumps({"error": repr(error), "traceback": traceback.format_exc()}))
    lines = [json.loads(line) for line in printed.getvalue().splitlines() if line.startswith("{")]
    write_report(out, "modes", os.getpid(), {"name": name, "code": code, "lines": lines})
    return code


if __name__ == "__main__":
    sys.exit(main())

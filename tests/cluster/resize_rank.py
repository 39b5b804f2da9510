"""A rank of the emulated cluster's resize test: ``tests/parallel/resize_script.py``'s rank
(a Synchronous DDP job that grows and shrinks), started by ``gradstar worker`` on a host (host
N's rank is IDENT N and asks for rank N) or by the test itself (``python -m
tests.cluster.resize_rank OUT IDENT --joiner``). ``RESIZE_LEAVER=1`` makes it the rank that
leaves. What the script prints goes to ``OUT/resize-IDENT.json``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

from tests.cluster.report import write_report
from tests.parallel import resize_script


def main() -> int:
    out, rest = Path(sys.argv[1]), sys.argv[2:]
    if rest and not rest[0].startswith("-"):
        ident = rest.pop(0)
    else:  # under the worker: host N's rank asks for rank N (rank 0's model is the replay's)
        ident = os.environ["CLUSTER_HOST"].removeprefix("host")
        os.environ["GRADSTAR_RANK"] = ident
    flags = [*rest, *(["--leaver"] if os.environ.get("RESIZE_LEAVER") == "1" else [])]
    printed = io.StringIO()
    sys.argv = [sys.argv[0], ident, *flags]
    with contextlib.redirect_stdout(printed):
        code = resize_script.main()
    lines = [json.loads(line) for line in printed.getvalue().splitlines() if line.startswith("{")]
    write_report(out, "resize", int(ident), {"ident": int(ident), "code": code,
                                             "lines": lines})
    return code


if __name__ == "__main__":
    sys.exit(main())

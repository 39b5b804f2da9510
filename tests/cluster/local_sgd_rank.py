"""A rank of the DiLoCo resize test across hosts, started by ``gradstar worker`` on a host of
the emulated cluster: ``tests/parallel/local_sgd_script.py elastic ...``; host N's rank asks
for rank N and trains as ``--ident N``, its printed lines saved to ``OUT/linesIDENT.jsonl``
once it ends (the worker keeps no output a test can read)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from tests.parallel import local_sgd_script as script


def main() -> None:
    ident = os.environ["CLUSTER_HOST"].removeprefix("host")
    os.environ["GRADSTAR_RANK"] = ident
    sys.argv = [script.__file__, *sys.argv[1:], "--ident", ident]
    out = Path(sys.argv[2])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        script.main()
    (out / f"lines{ident}.jsonl.part").write_text(printed.getvalue())
    (out / f"lines{ident}.jsonl.part").rename(out / f"lines{ident}.jsonl")


if __name__ == "__main__":
    main()

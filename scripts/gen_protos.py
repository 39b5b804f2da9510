"""Regenerate the committed gRPC stubs from protos/.

Usage: python scripts/gen_protos.py [--check]

--check regenerates into a temporary folder and exits 1 if the committed stubs differ, which is
what CI runs so stale stubs cannot land.
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT_PACKAGE = Path("gradstar") / "proto" / "v1"


def generate(out_root: Path) -> None:
    sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / OUT_PACKAGE).glob("*.proto"))
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTOS}",
        f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
        *sources,
    ]
    subprocess.run(cmd, check=True, cwd=PROTOS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args()
    committed = ROOT / "src" / OUT_PACKAGE
    if not args.check:
        generate(ROOT / "src")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / OUT_PACKAGE
        names = sorted(p.name for p in fresh.iterdir() if p.is_file())
        stale = [n for n in names if not (committed / n).exists()
                 or not filecmp.cmp(fresh / n, committed / n, shallow=False)]
        extra = sorted(p.name for p in committed.glob("*_pb2*") if p.name not in names)
        if stale or extra:
            print(f"stale generated stubs: {stale + extra}; run python scripts/gen_protos.py")
            return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

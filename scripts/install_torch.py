"""The torch step of ``make setup``: install the torch build that ``TORCH`` names.

    python scripts/install_torch.py cpu|cuda|none [--index URL]

- ``cpu`` (the default of the Makefile): on Linux, the CPU wheel from PyTorch's CPU index
  (``--index``, default https://download.pytorch.org/whl/cpu), about 200 MB. Plain
  ``pip install torch`` on Linux x86-64 gets PyPI's build instead, which bundles CUDA (several
  GB). When the index does not answer (offline, a firewall, a local mirror configured for pip),
  pip's own configuration decides where torch comes from, as it does without this step. On
  macOS and Windows PyPI's wheels are CPU builds already.
- ``cuda``: the wheel pip's configured index serves (on Linux x86-64, PyPI's CUDA build).
- ``none``: no torch here (gradstar with numpy only).

The version is the pin in constraints.txt. The rest of the project is installed afterwards by
the Makefile and keeps the torch installed here (it satisfies the pin). Exit status 2 for an
unknown choice, pip's status when pip fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: Seconds to wait for the CPU index before falling back to pip's configured sources.
PROBE_TIMEOUT = 5.0


def _say(message: str) -> None:
    print(f"make setup: {message}", flush=True)


def index_answers(index: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether ``index`` (a PEP 503 simple index) serves a torch page; proxies as pip sees them
    (``HTTPS_PROXY``), one short request, no retries."""
    request = urllib.request.Request(index.rstrip("/") + "/torch/", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return True
    except (OSError, ValueError):  # URLError, timeouts and HTTP errors are OSErrors
        return False


def installed_torch() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def pip_install(*args: str) -> int:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "-c",
               str(ROOT / "constraints.txt"), *args, "torch"]
    return subprocess.run(command, check=False).returncode


def install(choice: str, index: str) -> int:
    have = installed_torch()
    if choice == "none":
        _say("TORCH=none: no torch" + (f" (torch {have} stays installed; `make clean` "
                                       "removes it with the venv)" if have else ""))
        return 0
    if choice == "cuda" or not sys.platform.startswith("linux"):
        # A CPU build replaced by the CUDA one must be reinstalled: it satisfies the pin too.
        again = ("--force-reinstall", "--no-deps") if choice == "cuda" and have and \
            have.endswith("+cpu") else ()
        _say(f"TORCH={choice}: torch from pip's configured index")
        return pip_install(*again)
    if not index or not index_answers(index):
        _say(f"TORCH=cpu: {index or 'no CPU index'} does not answer; torch comes from pip's "
             "configured sources (on Linux x86-64 PyPI's is the CUDA build: see README)")
        return pip_install()
    again = ("--force-reinstall", "--no-deps") if have and not have.endswith("+cpu") else ()
    _say(f"TORCH=cpu: torch's CPU build from {index}")
    return pip_install("--index-url", index, *again)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("torch", help="cpu, cuda or none")
    parser.add_argument("--index", default=CPU_INDEX,
                        help=f"the CPU wheel index (default {CPU_INDEX}); empty: pip decides")
    args = parser.parse_args(argv)
    if args.torch not in ("cpu", "cuda", "none"):
        print(f"make setup: TORCH must be cpu, cuda or none, not {args.torch!r}",
              file=sys.stderr)
        return 2
    return install(args.torch, args.index)


if __name__ == "__main__":
    raise SystemExit(main())

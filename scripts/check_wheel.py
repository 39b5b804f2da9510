"""Build the wheel, install it into a clean venv, and import every module it should contain.

An editable install imports subpackages that the explicit package list forgot; the wheel does
not. This script fails if any Python file in the source folders is missing from the wheel or
fails to import from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def expected_modules() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    modules = set()
    for package, folder in mapping.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if rel.parts[0].startswith("gradstar") or "__pycache__" in rel.parts:
                continue
            modules.add(".".join((package, *rel.parts)).removesuffix(".__init__"))
    return modules


def _import_all(python: Path, modules: list[str], cwd: str, allow_missing: str = "") -> list[str]:
    """Import ``modules`` in the venv; return those that failed only for lack of
    ``allow_missing``. Any other failure raises CalledProcessError."""
    probe = (
        "import importlib, json, sys\n"
        f"allowed = {allow_missing!r}\n"
        "missing = []\n"
        f"for m in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if not allowed or e.name != allowed:\n"
        "            raise\n"
        "        missing.append(m)\n"
        "import gradstar; assert gradstar.__file__.startswith(sys.prefix), gradstar.__file__\n"
        "print(json.dumps(missing))\n"
    )
    out = subprocess.run([str(python), "-c", probe], check=True, cwd=cwd, stdout=subprocess.PIPE,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                        "-w", str(tmp_path), str(ROOT)], check=True)
        (wheel,) = tmp_path.glob("gradstar-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            in_wheel = {n[:-3].replace("/", ".").removesuffix(".__init__")
                        for n in archive.namelist() if n.endswith(".py")}
        missing = sorted(expected_modules() - in_wheel)
        if missing:
            print(f"modules missing from the wheel: {missing}")
            return 1
        venv = tmp_path / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = venv / "bin" / "python"
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], check=True)
        # First without torch (numpy users install gradstar alone): every module that does not
        # need the torch extra must import. Then with the extra, pinned by constraints.txt.
        modules = sorted(m for m in in_wheel if not m.endswith("__main__"))
        needs_torch = _import_all(python, modules, tmp, allow_missing="torch")
        print(f"without torch: {len(modules) - len(needs_torch)} modules imported; "
              f"need the torch extra: {needs_torch}")
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-c",
                        str(ROOT / "constraints.txt"), f"{wheel}[torch]"], check=True)
        _import_all(python, modules, tmp)
        print(f"with torch: all {len(modules)} modules imported from the installed wheel")
        subprocess.run([str(venv / "bin" / "gradstar"), "--help"], check=True,
                       stdout=subprocess.DEVNULL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

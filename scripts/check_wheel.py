"""Build the wheel, install it into a clean venv, and import every module it should contain.

An editable install imports subpackages that the explicit package list forgot; the wheel does
not. This script fails if any Python file in the source folders is missing from the wheel or
fails to import from it.
"""

from __future__ import annotations

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
        probe = (
            "import importlib, sys\n"
            # __main__ runs the CLI when imported; it is exercised by `gradstar --help` below.
            f"mods = {sorted(m for m in in_wheel if not m.endswith('__main__'))!r}\n"
            "for m in mods:\n"
            "    importlib.import_module(m)\n"
            "import gradstar; assert gradstar.__file__.startswith(sys.prefix), gradstar.__file__\n"
            "print(f'imported {len(mods)} modules from the installed wheel')\n"
        )
        subprocess.run([str(python), "-c", probe], check=True, cwd=tmp)
        subprocess.run([str(venv / "bin" / "gradstar"), "--help"], check=True,
                       stdout=subprocess.DEVNULL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

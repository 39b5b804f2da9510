"""The wheel's package list matches the folders on disk, and the public API is pinned.

A subpackage missing from ``[tool.setuptools].packages`` still imports in an editable install
but is absent from the wheel, so the list is checked against the folders here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import gradstar

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
LISTED = SETUPTOOLS["packages"]

EXPECTED_PACKAGE_DIR = {
    "gradstar": "src/gradstar",
    "gradstar.coordinator": "coordinator",
    "gradstar.worker": "worker",
    "gradstar.client": "client",
}

EXPECTED_ALL = [
    "DDP",
    "FSDP",
    "AsyncProcessGroup",
    "Asynchronous",
    "BoundedStaleness",
    "DataParallel",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "GradstarError",
    "LocalSGD",
    "Pipeline",
    "ProcessGroup",
    "Quorum",
    "StreamingDiLoCo",
    "Synchronous",
    "Work",
    "__version__",
    "create_distributed_data_parallel",
    "errors",
    "init_process_group",
    "init_process_group_async",
]


def packages_on_disk() -> dict[str, Path]:
    """{dotted name: folder} of every folder with an __init__.py under the mapped roots."""
    found: dict[str, Path] = {}
    for root_name, folder in PACKAGE_DIR.items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root)
            found[".".join((root_name, *relative.parts))] = init.parent
    return found


def folder_of(package: str) -> Path:
    """Where setuptools looks for ``package``: the longest mapped prefix, then subfolders."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in PACKAGE_DIR:
            return ROOT / PACKAGE_DIR[prefix] / Path(*parts[cut:])
    return ROOT / Path(*parts)


def test_package_dir_maps_the_four_role_folders():
    assert PACKAGE_DIR == EXPECTED_PACKAGE_DIR


def test_every_package_folder_on_disk_is_listed():
    missing = sorted(set(packages_on_disk()) - set(LISTED))

    assert missing == [], f"add {missing} to [tool.setuptools].packages or they miss the wheel"


def test_every_listed_package_is_a_folder_on_disk():
    stale = sorted(set(LISTED) - set(packages_on_disk()))

    assert stale == [], f"{stale} are listed in [tool.setuptools].packages but have no folder"


def test_listed_packages_are_unique():
    assert len(LISTED) == len(set(LISTED))


@pytest.mark.parametrize("package", LISTED)
def test_each_listed_package_resolves_to_its_folder(package):
    assert (folder_of(package) / "__init__.py").is_file()


def test_every_folder_of_modules_is_a_package():
    # A folder of .py files without __init__.py would import as a namespace package in an
    # editable install and silently miss the wheel.
    on_disk = set(packages_on_disk().values())
    for folder in PACKAGE_DIR.values():
        for module in (ROOT / folder).rglob("*.py"):
            assert module.parent in on_disk, f"{module.parent} has modules but no __init__.py"


def test_gradstar_all_is_pinned():
    assert gradstar.__all__ == EXPECTED_ALL


@pytest.mark.parametrize("name", EXPECTED_ALL)
def test_every_exported_name_exists(name):
    assert getattr(gradstar, name) is not None


def test_version_matches_the_distribution_metadata():
    assert gradstar.__version__ == PYPROJECT["project"]["version"]


def test_the_cli_reports_its_version():
    out = subprocess.run([sys.executable, "-m", "gradstar", "--version"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == f"gradstar {gradstar.__version__}"


def test_the_package_is_marked_typed_and_ships_the_marker():
    assert (ROOT / "src" / "gradstar" / "py.typed").is_file()
    assert "py.typed" in SETUPTOOLS["package-data"]["gradstar"]


def test_grpc_core_logging_is_quiet_unless_asked_for():
    probe = "import gradstar, os; print(os.environ['GRPC_VERBOSITY'])"
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    quiet = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=60, check=True, env=env).stdout.strip()
    asked = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=60, check=True, env={**env, "GRPC_VERBOSITY": "DEBUG"})
    assert (quiet, asked.stdout.strip()) == ("ERROR", "DEBUG")

"""Set-up paths: the Makefile's TORCH choice (read with ``make -n`` against a scratch venv
path, so nothing is installed), the torch step's decisions, and the files a release carries
(LICENSE, CHANGELOG.md)."""

from __future__ import annotations

import hashlib
import http.server
import importlib.util
import os
import re
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

import gradstar

from .compose import ROOT

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def make(*args: str, venv: Path) -> subprocess.CompletedProcess:
    # Not what an outer `make test TORCH=...` passes down (MAKEFLAGS carries its variables).
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH", "TORCH_CPU_INDEX", "VENV")}
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args,
                           f"VENV={venv}"], capture_output=True, text=True, timeout=60,
                          check=False, env=env)


# -- Makefile --------------------------------------------------------------------------------


@pytest.mark.parametrize(("torch", "extras"), [
    ("cpu", '".[dev,torch,plot]"'), ("cuda", '".[dev,torch,plot]"'), ("none", '"."')])
def test_make_setup_installs_the_torch_build_that_torch_names(tmp_path, torch, extras):
    venv = tmp_path / "venv"
    plan = make("-n", "setup", f"TORCH={torch}", venv=venv)
    assert plan.returncode == 0, plan.stderr
    steps = plan.stdout.splitlines()
    torch_step = f'{venv}/bin/python scripts/install_torch.py "{torch}" --index "{CPU_INDEX}"'
    project_step = f"{venv}/bin/python -m pip install --quiet -c constraints.txt -e {extras}"
    assert steps.index(torch_step) < steps.index(project_step), plan.stdout
    assert steps[-1] == f"touch {venv}/.installed-stamp"
    assert not venv.exists()  # -n ran nothing


def test_cpu_is_the_default_and_a_choice_is_remembered(tmp_path):
    venv = tmp_path / "venv"
    assert '"cpu"' in make("-n", "setup", venv=venv).stdout
    venv.mkdir()
    (venv / ".torch").write_text("cuda\n")
    assert '"cuda"' in make("-n", "setup", venv=venv).stdout


def test_the_stamp_depends_on_the_project_the_pins_and_the_torch_choice():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "STAMP := $(VENV)/.installed-stamp" in makefile
    assert re.search(r"^\$\(STAMP\): pyproject\.toml constraints\.txt \$\(TORCH_FILE\)$",
                     makefile, re.M)


@pytest.mark.parametrize("target", ["demo", "test", "lint", "wheel-check"])
def test_targets_that_need_the_full_set_up_refuse_torch_none(tmp_path, target):
    venv = tmp_path / "venv"
    done = make(target, "TORCH=none", venv=venv)
    assert done.returncode == 2
    assert (f"make: TORCH=none sets up gradstar alone (numpy only); 'make {target}' needs the "
            "full set-up: add TORCH=cpu or TORCH=cuda") in done.stderr
    assert not venv.exists()  # refused before anything was created


# -- scripts/install_torch.py ----------------------------------------------------------------


@pytest.fixture
def installer(monkeypatch):
    """scripts/install_torch.py as a module, with pip replaced by a recorder."""
    spec = importlib.util.spec_from_file_location("install_torch",
                                                  ROOT / "scripts" / "install_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.calls = []
    monkeypatch.setattr(module, "pip_install", lambda *args: module.calls.append(args) or 0)
    monkeypatch.setattr(module.sys, "platform", "linux")
    return module


@pytest.mark.parametrize(("choice", "answers", "installed", "pip_args"), [
    ("cpu", True, None, ("--index-url", CPU_INDEX)),
    ("cpu", True, "2.13.0+cpu", ("--index-url", CPU_INDEX)),  # already the CPU build
    ("cpu", True, "2.13.0", ("--index-url", CPU_INDEX, "--force-reinstall", "--no-deps")),
    ("cpu", False, None, ()),  # offline or mirrored: pip's configuration decides
    ("cuda", True, None, ()),
    ("cuda", True, "2.13.0+cpu", ("--force-reinstall", "--no-deps")),
    ("none", True, "2.13.0", None),
])
def test_the_torch_step_decides_by_choice_index_and_what_is_installed(
        installer, monkeypatch, choice, answers, installed, pip_args):
    monkeypatch.setattr(installer, "index_answers", lambda index, timeout=5.0: answers)
    monkeypatch.setattr(installer, "installed_torch", lambda: installed)
    assert installer.main([choice]) == 0
    assert installer.calls == ([] if pip_args is None else [pip_args])


def test_an_unknown_torch_choice_is_one_line_and_status_2():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_torch.py"), "rocm"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "make setup: TORCH must be cpu, cuda or none, not 'rocm'\n")


def test_the_index_probe_is_quick_when_nothing_answers_and_true_when_an_index_does(
        installer, tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    began = time.monotonic()
    # A refused connection is an answer at once: far less than the probe's timeout, which a
    # probe that waited or retried would use up.
    assert not installer.index_answers(f"http://127.0.0.1:{closed}/whl/cpu", timeout=30)
    assert time.monotonic() - began < 15
    (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
    (tmp_path / "whl" / "cpu" / "torch" / "index.html").write_text("<html></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert installer.index_answers(f"http://127.0.0.1:{port}/whl/cpu", timeout=5)
        assert not installer.index_answers(f"http://127.0.0.1:{port}/whl/nothing", timeout=5)
    finally:
        server.shutdown()
        thread.join(timeout=10)


# -- LICENSE, CHANGELOG, README --------------------------------------------------------------

#: SHA-256 of the Apache License 2.0 text as the ASF publishes it (LICENSE-2.0.txt).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_the_license_is_the_full_apache_2_text_that_pyproject_declares():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == {"text": "Apache-2.0"}


def test_the_changelog_keeps_a_changelog_with_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert text.startswith("# Changelog\n")
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions[0] == "Unreleased"
    assert gradstar.__version__ in versions
    assert re.search(rf"^## \[{re.escape(gradstar.__version__)}\] - \d{{4}}-\d\d-\d\d$", text,
                     re.M)
    sections = set(re.findall(r"^### (\w+)$", text, re.M))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def test_readme_says_how_to_reach_the_cli_and_install_gradstar_and_has_no_local_paths():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "source .venv/bin/activate" in readme and ".venv/bin/gradstar" in readme
    assert 'pip install "/path/to/gradstar[torch]"' in readme
    for choice in ("cpu", "cuda", "none"):
        assert f"| `{choice}`" in readme, choice
    assert str(ROOT) not in readme
    assert "all_gather_into_tensor" not in readme  # deprecated by torch 2.13

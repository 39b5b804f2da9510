"""MkDocs hooks (mkdocs.yml ``hooks:``): lay out the ``gradstar`` package for mkdocstrings.

The distribution remaps folders (pyproject's ``package-dir``): ``gradstar`` is ``src/gradstar``
but ``gradstar.client`` is ``client/``, ``gradstar.coordinator`` is ``coordinator/`` and
``gradstar.worker`` is ``worker/``. mkdocstrings' Python handler (griffe) reads source from
folders on a search path and cannot follow that remapping, so before the build this hook lays
the package out as an installed wheel would have it, in ``build/docs-python/gradstar``, out of
symbolic links to the sources (so the pages always show the working tree's docstrings), and
mkdocs.yml points the handler there.

The docstrings name other objects with Sphinx roles (``:class:`Work```); the Markdown they are
rendered with has no roles, so a page would show ``:class:`` before the name. The second hook
drops the role and, for ``~a.b.C``, shows ``C`` as Sphinx would.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "docs-python"
#: A Sphinx role as the page renders it: ``:class:<code>~gradstar.config.ClientSettings</code>``.
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):"
                  r"<code>(~?)([^<]*)</code>")


def lay_out_package(root: Path = ROOT, tree: Path = TREE) -> Path:
    """Build ``tree/gradstar`` from pyproject's package-dir and return ``tree``."""
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir: dict[str, str] = project["tool"]["setuptools"]["package-dir"]
    if tree.exists():
        shutil.rmtree(tree)
    top = tree / "gradstar"
    top.mkdir(parents=True)
    remapped = {name.split(".", 1)[1]: folder for name, folder in package_dir.items()
                if name.startswith("gradstar.")}
    for entry in (root / package_dir["gradstar"]).iterdir():
        if entry.name not in remapped and entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for name, folder in remapped.items():
        (top / name).symlink_to(root / folder)
    return tree


# First of all on_config handlers: mkdocstrings' Python handler keeps only search paths that
# exist when it is set up, in its own on_config.
@event_priority(100)
def on_config(config, **_kwargs):
    lay_out_package()
    return config


def show_name(match: re.Match) -> str:
    short, name = match.groups()
    return f"<code>{name.rsplit('.', 1)[-1] if short else name}</code>"


def on_page_content(html: str, **_kwargs) -> str:
    return ROLE.sub(show_name, html)

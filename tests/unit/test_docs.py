"""The documentation site, checked without building it (no network, no mkdocs): every public
name of ``gradstar`` has its place in the API reference, every error class its entry on the
troubleshooting page, every page is in the navigation, every relative link of README.md
resolves to a file (a page of the site, when it points into docs/), and the module map in
docs/development.md ("Layout") names every module of the source folders and nothing else.

``make docs`` (``mkdocs build --strict``, run by CI) checks the rest: that every ``:::`` name
resolves in the source, and every link and anchor between pages.
"""

from __future__ import annotations

import importlib
import re
import unicodedata
from pathlib import Path

import pytest
import yaml

import gradstar
from gradstar import errors

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"

#: ``::: dotted.name`` and the indented options block under it.
DIRECTIVE = re.compile(r"^::: ([\w.]+)[ \t]*\n((?:[ \t]+.*\n)*)", re.M)
#: ``[text](target)`` and ``![alt](target)``; a target has no spaces.
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def resolve(dotted: str) -> object:
    """The object a ``:::`` name stands for: the longest importable module prefix, then
    attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(dotted)


def directives() -> list[tuple[str, str, str]]:
    """(page, name, options) of every ``:::`` block on the reference pages."""
    found = []
    for page in sorted(REFERENCE.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        found += [(page.name, name, options) for name, options in DIRECTIVE.findall(text)]
    return found


def documented_objects() -> list[object]:
    """The objects the reference renders: each ``:::`` target, and a module's ``__all__`` unless
    its block says ``members: false``."""
    objects = []
    for _page, name, options in directives():
        target = resolve(name)
        objects.append(target)
        if hasattr(target, "__all__") and not re.search(r"members:\s*false", options):
            objects += [getattr(target, member) for member in target.__all__]
    return objects


def test_every_reference_directive_names_something_that_exists():
    names = [name for _page, name, _options in directives()]
    assert len(names) >= 10, names
    for name in names:
        resolve(name)  # raises, naming it, if it is gone


@pytest.mark.parametrize("name", gradstar.__all__)
def test_every_public_name_of_gradstar_is_in_the_api_reference(name):
    index = (REFERENCE / "index.md").read_text(encoding="utf-8")
    assert f"`gradstar.{name}`" in index, f"gradstar.{name} is not listed in {REFERENCE}/index.md"
    value = getattr(gradstar, name)
    if isinstance(value, str):  # __version__: a value, listed in the index only
        return
    assert any(value is documented for documented in documented_objects()), (
        f"gradstar.{name} is not rendered by any `:::` block in docs/reference/")


@pytest.mark.parametrize("name", errors.__all__)
def test_every_error_class_is_in_the_reference_and_on_the_troubleshooting_page(name):
    cls = getattr(errors, name)
    assert any(cls is documented for documented in documented_objects()), name
    troubleshooting = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    assert re.search(rf"^### {name}$", troubleshooting, re.M), (
        f"docs/troubleshooting.md has no section '### {name}': what it means, what to do")


def nav_pages() -> set[str]:
    """Every page named in mkdocs.yml's nav, relative to docs/."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8").replace(
        "!!python/name:", ""))
    pages: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, str):
            pages.add(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for item in node.values():
                walk(item)

    walk(config["nav"])
    return pages


def test_every_page_is_in_the_navigation_and_every_navigation_entry_is_a_page():
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert nav_pages() == pages


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (its default slugify)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {slug(heading) for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M)}


def readme_links() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # no links inside code
    return LINK.findall(text)


def test_every_relative_link_of_the_readme_resolves():
    links = [link for link in readme_links() if not re.match(r"[a-z]+:", link)]
    assert any(link.startswith("docs/") for link in links), links
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README.md links to {link}, which does not exist"
        if target.suffix == ".md" and target.is_relative_to(DOCS):
            assert str(target.relative_to(DOCS)) in nav_pages(), f"{link} is not in the site"
            if anchor:
                assert anchor in anchors(target), f"{link}: no heading gives #{anchor}"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, len(lines)


#: The folders whose modules docs/development.md's layout must name (generated stubs excepted).
SOURCE_FOLDERS = ("src/gradstar/", "coordinator/", "client/", "worker/")
GENERATED = "src/gradstar/proto/"
#: Where an entry's description starts in the layout block; a line indented this far or more
#: goes on describing the entry above it.
DESCRIPTION_COLUMN = 20
MODULE = re.compile(r"(?<![\w./])([\w/]+\.py)\b")


def layout_block() -> str:
    text = (DOCS / "development.md").read_text(encoding="utf-8")
    match = re.search(r"^## Layout\n\n```\n(.*?)^```", text, re.M | re.S)
    assert match, "docs/development.md has no '## Layout' section with a code block"
    return match.group(1)


def layout_names() -> tuple[set[str], set[str]]:
    """(modules, folders) that the layout names, as paths from the repository root.

    A line indented less than :data:`DESCRIPTION_COLUMN` starts an entry: a folder (``name/``),
    nested in the folders above it by indentation, or files of the folder it sits in. A module
    (``name.py``) named anywhere on an entry or the lines describing it belongs to that folder,
    unless it is written from the root (``coordinator/collective/engine.py``).
    """
    modules: set[str] = set()
    folders: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path ending in "/")
    for line in layout_block().splitlines():
        stripped = line.lstrip()
        if not stripped:
            continue
        indent = len(line) - len(stripped)
        if indent < DESCRIPTION_COLUMN:
            while stack and stack[-1][0] >= indent:
                stack.pop()
            first = stripped.split()[0]
            if first.endswith("/"):
                stack.append((indent, (stack[-1][1] if stack else "") + first))
                folders.add(stack[-1][1])
        folder = stack[-1][1] if stack else ""
        for name in MODULE.findall(line):
            modules.add(name if name.startswith(SOURCE_FOLDERS) else folder + name)
    return ({m for m in modules if m.startswith(SOURCE_FOLDERS)},
            {f for f in folders if f.startswith(SOURCE_FOLDERS)})


def modules_on_disk() -> tuple[set[str], set[str]]:
    """(modules but __init__.py, package folders) under the source folders, stubs excepted."""
    modules: set[str] = set()
    folders: set[str] = set()
    for root in SOURCE_FOLDERS:
        for path in (ROOT / root).rglob("*.py"):
            name = path.relative_to(ROOT).as_posix()
            if name.startswith(GENERATED) or "__pycache__" in name:
                continue
            if path.name == "__init__.py":
                folders.add(name.removesuffix("__init__.py"))
            else:
                modules.add(name)
    return modules, folders - set(SOURCE_FOLDERS)


def test_the_layout_names_every_module_and_folder():
    named_modules, named_folders = layout_names()
    modules, folders = modules_on_disk()
    assert sorted(modules - named_modules) == [], (
        "docs/development.md's layout does not name these modules: add each where it lives")
    assert sorted(folders - named_folders) == [], (
        "docs/development.md's layout does not name these packages as folders ('name/')")


def test_every_module_the_layout_names_exists():
    named_modules, named_folders = layout_names()
    assert sorted(m for m in named_modules if not (ROOT / m).is_file()) == [], (
        "docs/development.md's layout names modules that do not exist (moved or gone?)")
    assert sorted(f for f in named_folders if not (ROOT / f).is_dir()) == [], (
        "docs/development.md's layout names folders that do not exist")


def test_the_layout_check_sees_a_missing_and_a_stale_module():
    named_modules, _ = layout_names()
    modules, _ = modules_on_disk()
    assert "coordinator/collective/engine.py" in named_modules
    assert "client/collective/plan.py" in named_modules
    assert "src/gradstar/proto/v1/collective_pb2.py" not in modules
    assert len(named_modules) >= 100, len(named_modules)

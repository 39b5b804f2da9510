"""The layering of DESIGN.md §1, checked from the code's own imports.

- No import circles between gradstar's modules (imports inside functions count too: a circle
  hidden in a function is still a circle).
- A rank never loads the hub: nothing in ``gradstar.client`` imports ``gradstar.coordinator``,
  and importing ``gradstar`` or any rank-side module leaves ``gradstar.coordinator`` unloaded.
- Nothing under ``src/gradstar`` imports torch, and ``import gradstar`` loads neither torch nor
  the hub.
- No module is over :data:`MAX_LINES` lines but those docs/development.md lists, each with its
  limit and why (:data:`PAST_LIMIT`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR: dict[str, str] = tomllib.loads(
    (ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]


def _modules() -> dict[str, Path]:
    """{dotted module name: file} for every hand-written module (generated stubs excluded)."""
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIR.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            if rel.parts[0] in ("gradstar", "proto") or "__pycache__" in rel.parts:
                continue
            found[".".join((package, *rel.parts)).removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """The gradstar modules that module ``name`` imports, anywhere in its body."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name if _is_package(name) else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets.add(base)
            # `from pkg import module` imports the submodule.
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    return {t for t in targets if t in MODULES and t != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            # A package's __init__ re-exporting its own modules is not a circle of the layering.
            if nxt.startswith(node + ".") and _is_package(node):
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    return found


def test_the_module_list_covers_the_layout():
    for name in ("gradstar.ops", "gradstar.wire", "gradstar.transport.channels",
                 "gradstar.coordinator.collective.matching", "gradstar.client.collective.stream",
                 "gradstar.client.peer.server", "gradstar.client.fsdp.wrapper"):
        assert name in MODULES


#: Top-level entries (modules and folders) the hub may have: past this, its rooms stop telling
#: its architecture (issue 34). A new subsystem gets a folder (the 11th: leadership/, --ha).
MAX_HUB_ENTRIES = 11


def test_the_hub_top_level_stays_small():
    hub = ROOT / PACKAGE_DIR["gradstar.coordinator"]
    entries = sorted(p.name for p in hub.iterdir()
                     if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file()))
    assert len(entries) <= MAX_HUB_ENTRIES, entries


def test_no_import_circles():
    assert _cycles() == []


def test_the_circle_finder_finds_a_circle():
    GRAPH["gradstar.wire"].add("gradstar.ops.geometry")  # ops imports wire: this closes a circle
    try:
        assert ["gradstar.ops.geometry", "gradstar.wire"] in _cycles()
    finally:
        GRAPH["gradstar.wire"].discard("gradstar.ops.geometry")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("gradstar.client")))
def test_rank_side_modules_never_import_the_hub(name):
    assert not any(t.startswith("gradstar.coordinator") for t in GRAPH[name])


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("gradstar.coordinator")))
def test_the_hub_never_imports_the_client(name):
    assert not any(t.startswith("gradstar.client") for t in GRAPH[name])


@pytest.mark.parametrize("name", sorted(
    n for n in MODULES if not n.startswith(("gradstar.client", "gradstar.coordinator",
                                            "gradstar.worker"))))
def test_the_core_never_imports_torch(name):
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        assert not any(n == "torch" or n.startswith("torch.") for n in names), name


def _loaded_after(statement: str) -> set[str]:
    probe = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return set(out.split())


def test_import_gradstar_loads_neither_the_hub_nor_torch():
    loaded = _loaded_after("import gradstar")
    assert not {m for m in loaded if m.startswith("gradstar.coordinator")}
    assert "torch" not in loaded


def test_ml_dtypes_is_imported_only_when_a_bfloat16_is_met():
    # Two thirds of `import gradstar` was ml_dtypes' (0.65 s of CPU): a rank that joins late
    # pays its imports before its first gradient (issue 47).
    assert "ml_dtypes" not in _loaded_after(
        "import gradstar, gradstar.client, gradstar.wire.formats\n"
        "from gradstar.wire import dtype_info, dtype_from_wire\n"
        "dtype_info('float32'); dtype_from_wire(1)")
    assert "ml_dtypes" in _loaded_after(
        "from gradstar.wire import dtype_info\nassert dtype_info('bfloat16').name == 'bfloat16'")
    assert "ml_dtypes" in _loaded_after(
        "from gradstar.wire.formats import FORMATS\nassert FORMATS['bf16'].cast.itemsize == 2")


def test_a_training_rank_never_loads_the_hub():
    # Everything a rank imports: the SDK with its torch wrappers, the backend, the demo's
    # training entry point and the host agent that starts ranks.
    loaded = _loaded_after(
        "import gradstar, gradstar.client.torch_backend, gradstar.client.fsdp, "
        "gradstar.client.pipeline, gradstar.client.ddp, gradstar.worker.demo.train, "
        "gradstar.worker.host.agent\ngradstar.DDP, gradstar.FSDP, gradstar.Pipeline")
    assert "torch" in loaded  # the probe did reach the torch wrappers
    assert not {m for m in loaded if m.startswith("gradstar.coordinator")}


#: A module holds one idea; past this many lines it holds more, and its reader cannot see where
#: one ends (issue 27).
MAX_LINES = 450

#: Where the modules allowed past :data:`MAX_LINES` are listed, each with its limit and why.
DEVELOPMENT = ROOT / "docs" / "development.md"
PAST_LIMIT_HEADING = "### Modules past the line limit"


def past_limit(text: str) -> dict[str, tuple[int, str]]:
    """The table under :data:`PAST_LIMIT_HEADING` in ``text`` (docs/development.md): {module
    path: (lines at most, why)}, read from its rows ``| `path` | lines | why |``.

    Raises:
        AssertionError: the heading is missing, or a row is not of that form.
    """
    assert PAST_LIMIT_HEADING in text, f"docs/development.md has no {PAST_LIMIT_HEADING!r}"
    section = text.split(PAST_LIMIT_HEADING, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # head, rule
    table: dict[str, tuple[int, str]] = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("`") and (
            cells[1].isdigit()) and cells[2], f"not a row of module, lines, why: {row!r}"
        table[cells[0].strip("`")] = (int(cells[1]), cells[2])
    return table


#: The modules allowed past :data:`MAX_LINES` (docs/development.md), by dotted name.
PAST_LIMIT: dict[str, tuple[int, str]] = {}
for _path, _entry in past_limit(DEVELOPMENT.read_text(encoding="utf-8")).items():
    _found = [name for name, file in MODULES.items() if file == ROOT / _path]
    assert _found, f"docs/development.md lists {_path} past the line limit: no such module"
    PAST_LIMIT[_found[0]] = _entry


def _lines(name: str) -> int:
    return len(MODULES[name].read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_the_line_limit(name):
    limit = PAST_LIMIT.get(name, (MAX_LINES, ""))[0]
    why = (f"its limit in docs/development.md is {limit}" if name in PAST_LIMIT else
           f"split it along its seams (at most {MAX_LINES} lines), or, where it has none, "
           "list it in docs/development.md's 'Modules past the line limit' with why")
    assert _lines(name) <= limit, (
        f"{MODULES[name].relative_to(ROOT)} has {_lines(name)} lines, over {limit}: {why}")


def test_the_past_limit_list_only_names_modules_still_over():
    # A module that shrank below the limit leaves the table, so the table only says what is.
    assert {name for name in PAST_LIMIT if _lines(name) > MAX_LINES} == set(PAST_LIMIT)


def test_the_past_limit_table_is_read_with_each_reason():
    text = (f"# Dev\n{PAST_LIMIT_HEADING}\n\nprose\n\n| module | lines at most | why |\n"
            "|---|---|---|\n| `a/b.py` | 470 | one idea |\n| `c.py` | 500 | another |\n\n"
            "## Next\n| `d.py` | 9 | not in the section |\n")
    assert past_limit(text) == {"a/b.py": (470, "one idea"), "c.py": (500, "another")}
    with pytest.raises(AssertionError, match="not a row"):
        past_limit(text.replace("| 470 | one idea |", "| 470 | |"))  # no reason
    with pytest.raises(AssertionError, match="has no"):
        past_limit("# Dev\n")


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_no_benchmark_module_is_over_the_line_limit(path):
    # benchmarks/ is no package of the wheel, but its scripts are read as the modules are.
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (f"benchmarks/{path.name} has {lines} lines, over {MAX_LINES}: "
                                "split it along its seams")


# -- composition, not mixins that reach into their host ------------------------------------------


def _class_facts(tree: ast.Module) -> dict[str, tuple[set[str], set[str], list[str]]]:
    """{class name: (private ``self._x`` names it reads, names it sets or defines, its bases)}.
    Set: assigned to ``self`` (or by ``object.__setattr__(self, "_x", ...)``), or defined in
    the class body (methods, class attributes)."""
    facts = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        read, defined = set(), set()
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                defined.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                defined.add(item.target.id)
            elif isinstance(item, ast.Assign):
                defined.update(t.id for t in item.targets if isinstance(t, ast.Name))
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self" and sub.attr.startswith("_")
                    and not sub.attr.startswith("__")):
                (defined if isinstance(sub.ctx, ast.Store) else read).add(sub.attr)
            elif (isinstance(sub, ast.Call) and ast.unparse(sub.func) == "object.__setattr__"
                  and len(sub.args) >= 2 and isinstance(sub.args[1], ast.Constant)):
                defined.add(sub.args[1].value)
        facts[node.name] = (read, defined, [ast.unparse(b).split(".")[-1] for b in node.bases])
    return facts


def _reaching(facts: dict[str, tuple[set[str], set[str], list[str]]]) -> dict[str, set[str]]:
    """Classes that read private attributes neither they nor their bases (found by name among
    ``facts``) set: mixins that reach into their host's state. {class: those names}."""
    def defined(name: str, seen: frozenset = frozenset()) -> set[str]:
        if name not in facts or name in seen:
            return set()
        _, own, bases = facts[name]
        return own.union(*(defined(b, seen | {name}) for b in bases))

    return {name: missing for name, (read, _, _) in facts.items()
            if (missing := read - defined(name))}


def _every_class() -> dict[str, tuple[set[str], set[str], list[str]]]:
    facts = {}
    for path in MODULES.values():
        for cls, fact in _class_facts(ast.parse(path.read_text(encoding="utf-8"))).items():
            facts[cls] = fact if cls not in facts else tuple(
                a | b if isinstance(a, set) else a + b
                for a, b in zip(facts[cls], fact, strict=True))
    return facts


def test_no_class_reads_private_state_it_does_not_own():
    # A mixin that reads its host's private attributes hides a seam: the host should own an
    # object given what it needs (composition), as AsyncProcessGroup owns its PeerCalls.
    assert _reaching(_every_class()) == {}


def test_the_private_state_check_finds_a_mixin():
    tree = ast.parse(
        "class Host(Mixin):\n    def __init__(self):\n        self._state = 1\n"
        "class Mixin:\n    def peek(self):\n        return self._state + self._own()\n"
        "    def _own(self):\n        return 0\n"
        "class Owner(Host):\n    def read(self):\n        return self._state\n")
    assert _reaching(_class_facts(tree)) == {"Mixin": {"_state"}}

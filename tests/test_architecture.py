"""The rooms keep their doors: an import graph read from the package's source (an AST walk, no import).

- no import cycle between the package's modules;
- dependencies point one way: probe/ (the core) imports neither hooks/ (adapters) nor reports/; hooks/ and
  reports/ do not import each other; no room imports the top level (the facade ``attnprobe``, ``cli``),
  which alone sees every room;
- no private name (``_name``, or a private module) is imported from another module.

Every import statement counts: at module level, inside functions (lazy) and under ``TYPE_CHECKING``, and
so does ``importlib.import_module`` / ``__import__`` of a module named by a string constant.
The checker itself is tested on synthetic sources below, so a planted violation is shown to fail.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "attnprobe"
ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package
NOT_PACKAGE = {"tests", "benchmarks", "docs", "examples", "build", "dist"}

#: importer room -> rooms it must not import (a room is a module name prefix; PACKAGE alone is the facade)
FORBIDDEN = {
    f"{PACKAGE}.probe": (f"{PACKAGE}.hooks", f"{PACKAGE}.reports", f"{PACKAGE}.cli", PACKAGE),
    f"{PACKAGE}.hooks": (f"{PACKAGE}.reports", f"{PACKAGE}.cli", PACKAGE),
    f"{PACKAGE}.reports": (f"{PACKAGE}.hooks", f"{PACKAGE}.cli", PACKAGE),
}
#: modules that live in a room for their public path but consume the whole package, with the reason
CONSUMERS = {
    f"{PACKAGE}.probe.pytest_plugin": "the pytest plugin's fixtures are attnprobe.capture/run/assert_invariants, "
    "reached through the public facade; its path is the pytest11 entry point users may name",
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module of the package
    name: str | None  # the name imported from it (None: the module itself)
    line: int


def package_sources(root: Path = ROOT, package: str = PACKAGE) -> dict[str, str]:
    """``{module name: source}`` for every module of the package under ``root``."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in NOT_PACKAGE or any(p.startswith(".") for p in rel.parts):
            continue
        parts = rel.with_suffix("").parts
        name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
        sources[name] = path.read_text()
    return sources


def _is_package(name: str, sources: dict[str, str]) -> bool:
    return any(other.startswith(name + ".") for other in sources)


def imports_of(name: str, source: str, sources: dict[str, str]) -> list[Import]:
    """Every import of a package module by ``name``, wherever it stands in the file."""
    package = name if _is_package(name, sources) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in sources:
                    found.append(Import(name, alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module not in sources:
                continue
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                if submodule in sources:
                    found.append(Import(name, submodule, None, node.lineno))
                else:
                    found.append(Import(name, module, alias.name, node.lineno))
        elif isinstance(node, ast.Call) and _dynamic_import(node):  # importlib.import_module("...") / __import__
            target = node.args[0].value
            if target.startswith("."):  # relative to the anchor: the second argument
                anchor = node.args[1] if len(node.args) > 1 else None
                anchor_name = {"__name__": name, "__package__": package}.get(getattr(anchor, "id", None))
                if isinstance(anchor, ast.Constant) and isinstance(anchor.value, str):
                    anchor_name = anchor.value
                if anchor_name is None:
                    continue
                level = len(target) - len(target.lstrip("."))
                base = anchor_name.split(".")[: len(anchor_name.split(".")) - level + 1]
                target = ".".join(base + ([target.lstrip(".")] if target.lstrip(".") else []))
            if target in sources:
                found.append(Import(name, target, None, node.lineno))
    return found


def _dynamic_import(call: ast.Call) -> bool:
    """``importlib.import_module("a.b")``, ``import_module(".b", __name__)`` or ``__import__("a.b")``."""
    func = call.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return (
        called in ("import_module", "__import__")
        and bool(call.args)
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    )


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (or a module importing itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def problems(sources: dict[str, str], consumers: dict[str, str] = CONSUMERS) -> list[str]:
    """One line per broken rule, naming the file's module and line."""
    found = []
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, source in sources.items():
        for imp in imports_of(name, source, sources):
            graph[name].add(imp.target)
            where = f"{name} line {imp.line}: imports {imp.target}" + (f".{imp.name}" if imp.name else "")
            for room, forbidden in FORBIDDEN.items():
                if _in_room(name, room) and name not in consumers:
                    hit = [f for f in forbidden if (imp.target == f if f == PACKAGE else _in_room(imp.target, f))]
                    if hit:
                        found.append(f"{where}: {room} must not import {hit[0]}")
            if imp.name is not None and _private(imp.name) and imp.target != name:
                found.append(f"{where}: private name {imp.name!r} of another module (make it public where it lives)")
            private_module = next((p for p in imp.target.split(".") if _private(p)), None)
            if private_module and not _in_room(name, imp.target.rpartition(".")[0]):
                found.append(f"{where}: private module {private_module!r} from outside its package")
    found.sort()
    for group in cycles(graph):
        found.append("import cycle: " + " -> ".join(group + group[:1]))
    return found


# ------------------------------------------------------------------------------------------- the package
def test_the_package_has_no_cycle_no_wrong_way_import_and_no_private_name_across_modules():
    sources = package_sources()
    assert f"{PACKAGE}.probe.capture" in sources and f"{PACKAGE}.hooks.hf" in sources  # the walk found the rooms
    assert problems(sources) == []


def test_adapters_use_the_session_only_through_its_interface():
    from attnprobe.probe.interface import Session

    interface = set(Session.__annotations__) | {n for n in vars(Session) if not n.startswith("_")}
    used: dict[str, list[str]] = {}
    for name, source in package_sources().items():
        if not name.startswith(f"{PACKAGE}.hooks.") or name == f"{PACKAGE}.hooks.api":  # api.py owns the session
            continue
        for node in ast.walk(ast.parse(source)):
            value = getattr(node, "value", None)
            if isinstance(node, ast.Attribute) and (
                getattr(value, "id", None) == "session" or getattr(value, "attr", None) == "session"
            ):
                used.setdefault(node.attr, []).append(f"{name} line {node.lineno}")
    assert {"emit", "wants"} <= set(used)  # the walk sees the adapters' calls
    assert {k: v for k, v in used.items() if k not in interface} == {}, "add it to probe.interface.Session, or don't"


def test_every_consumer_exception_still_exists():
    assert set(CONSUMERS) <= set(package_sources())


# ------------------------------------------------------------------------------- the checker, on plants
def _pkg(**modules: str) -> dict[str, str]:
    """A synthetic package: keyword ``probe__capture`` is module ``attnprobe.probe.capture``."""
    sources = {PACKAGE: "", f"{PACKAGE}.probe": "", f"{PACKAGE}.hooks": "", f"{PACKAGE}.reports": ""}
    sources.update({f"{PACKAGE}." + key.replace("__", "."): text for key, text in modules.items()})
    return sources


def test_checker_passes_a_clean_package():
    sources = _pkg(
        probe__record="X = 1\n",
        probe__capture="from .record import X\n",
        hooks__own="from ..probe.capture import X\nfrom . import calls\n",
        hooks__calls="",
        reports__html="from ..probe.record import X\n",
        cli="from .hooks import own\nfrom .probe import capture\n",
    )
    assert problems(sources) == []


def test_checker_finds_a_cycle_through_a_lazy_import():
    sources = _pkg(
        hooks__a="from .b import f\n",
        hooks__b="def f():\n    from .c import g\n",
        hooks__c="from . import a\n",
    )
    assert problems(sources) == [
        f"import cycle: {PACKAGE}.hooks.a -> {PACKAGE}.hooks.b -> {PACKAGE}.hooks.c -> {PACKAGE}.hooks.a"
    ]


def test_checker_finds_probe_importing_hooks_at_any_depth():
    sources = _pkg(
        probe__capture="def session():\n    if True:\n        from ..hooks import own\n",
        probe__frames="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from attnprobe.reports.html import x\n",
        probe__plugin="def fixture():\n    import attnprobe\n",
        probe__loading="import importlib\nadapters = importlib.import_module('..hooks.own', __package__)\n"
        "html = __import__('attnprobe.reports.html')\n",
        hooks__own="",
        reports__html="x = 1\n",
    )
    found = problems(sources, consumers={})
    assert found == [
        f"{PACKAGE}.probe.capture line 3: imports {PACKAGE}.hooks.own: {PACKAGE}.probe must not import {PACKAGE}.hooks",
        f"{PACKAGE}.probe.frames line 3: imports {PACKAGE}.reports.html.x: "
        f"{PACKAGE}.probe must not import {PACKAGE}.reports",
        f"{PACKAGE}.probe.loading line 2: imports {PACKAGE}.hooks.own: {PACKAGE}.probe must not import {PACKAGE}.hooks",
        f"{PACKAGE}.probe.loading line 3: imports {PACKAGE}.reports.html: "
        f"{PACKAGE}.probe must not import {PACKAGE}.reports",
        f"{PACKAGE}.probe.plugin line 2: imports {PACKAGE}: {PACKAGE}.probe must not import {PACKAGE}",
    ]
    assert problems(sources, consumers={f"{PACKAGE}.probe.plugin": "a consumer"}) == found[:4]


def test_checker_finds_adapters_and_reports_importing_each_other():
    sources = _pkg(hooks__own="from ..reports import html\n", reports__html="import attnprobe.hooks.own\n")
    found = problems(sources)
    assert len(found) == 3 and "hooks must not import attnprobe.reports" in found[0]
    assert "reports must not import attnprobe.hooks" in found[1] and found[2].startswith("import cycle")


def test_checker_finds_private_names_and_private_modules_from_other_modules():
    sources = _pkg(
        probe__selection="def _int_list(x):\n    return x\n",
        probe__capture="from .selection import _int_list, __doc__\n",
        reports___common="def helper():\n    pass\n",
        reports__png="from ._common import helper\n",  # a private module inside its own package: fine
        hooks__own="from ..reports._common import helper\n",
    )
    found = problems(sources)
    assert found == [
        f"{PACKAGE}.hooks.own line 1: imports {PACKAGE}.reports._common.helper: {PACKAGE}.hooks must not import "
        f"{PACKAGE}.reports",
        f"{PACKAGE}.hooks.own line 1: imports {PACKAGE}.reports._common.helper: private module '_common' from "
        "outside its package",
        f"{PACKAGE}.probe.capture line 1: imports {PACKAGE}.probe.selection._int_list: private name '_int_list' of "
        "another module (make it public where it lives)",
    ]

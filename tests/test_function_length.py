"""Functions short enough to read at once: none in the package runs over 80 lines (an AST walk, nothing imported).

A function's length is its lines from ``def`` (its decorators excluded) to its last line, docstring included, as
ruff formats it. A longer function is split into named steps; the few that stay longer are listed in ``ALLOWED``
with the reason, and the test fails when an allowed one is gone (so the list never holds stale names). The checker
is tested on planted sources below.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package
NOT_PACKAGE = {"tests", "benchmarks", "docs", "examples", "build", "dist", "site"}
LIMIT = 80
#: "path:qualified name" -> why it stays longer than LIMIT
ALLOWED: dict[str, str] = {}


def package_files(root: Path = ROOT) -> list[Path]:
    return [
        p
        for p in sorted(root.rglob("*.py"))
        if p.relative_to(root).parts[0] not in NOT_PACKAGE
        and not any(x.startswith(".") for x in p.relative_to(root).parts)
    ]


def long_functions(source: str, limit: int = LIMIT) -> dict[str, int]:
    """``{qualified name: lines}`` of every function (methods and nested functions too) over ``limit`` lines."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > limit:
                        found[name] = lines
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_function_in_the_package_is_over_80_lines():
    found = {}
    for path in package_files():
        rel = path.relative_to(ROOT).as_posix()
        for name, lines in long_functions(path.read_text()).items():
            if f"{rel}:{name}" not in ALLOWED:
                found[f"{rel}:{name}"] = lines
    assert found == {}, "split these into named steps (or list one in ALLOWED with the reason)"


def test_every_allowed_long_function_still_exists_and_is_long():
    present = {
        f"{p.relative_to(ROOT).as_posix()}:{name}" for p in package_files() for name in long_functions(p.read_text())
    }
    assert set(ALLOWED) <= present


def test_the_walk_sees_the_package():
    names = {p.relative_to(ROOT).as_posix() for p in package_files()}
    assert {"cli.py", "probe/capture.py", "hooks/hf/adapter.py", "reports/html.py"} <= names
    assert not any(n.startswith("tests/") for n in names)


# ------------------------------------------------------------------------------------ the checker, on plants
def _body(n: int) -> str:
    return "".join("    x = 1\n" for _ in range(n))


def test_the_checker_counts_from_def_to_the_last_line():
    assert long_functions("def f():\n" + _body(79)) == {}  # 80 lines: allowed
    assert long_functions("def f():\n" + _body(80)) == {"f": 81}


def test_the_checker_finds_methods_and_nested_functions():
    source = (
        "class A:\n    def m(self):\n" + _body(85).replace("    x", "        x") + "def outer():\n    def inner():\n"
    )
    source += _body(85).replace("    x", "        x")
    assert long_functions(source) == {"A.m": 86, "outer": 87, "outer.inner": 86}

"""Habits the code keeps, read from its source (an AST walk, nothing imported).

Errors carry data, not sentences to parse: the command line never reads the text of an exception to decide what
to do or to reword it (``str(exc).split(". Select")``, ``str(exc).startswith("no attention found")``,
``.replace("attnprobe.attention_modules(model) lists them", ...)`` were), so that rewording a library message can
never silently change what the command prints. It reads the attributes the library's errors carry
(``probe/errors.py``) and may still show a message as it is, or its first line. The checker is tested on planted
sources below, the command line's old code among them, so a violation is shown to fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package
#: The files that speak for the command line.
COMMAND_LINE = [ROOT / "cli.py", *sorted((ROOT / "probe" / "commandline").glob("*.py"))]
#: (file, function) -> why its reading of an exception's text stays
ALLOWED = {
    ("probe/commandline/loading.py", "load_pretrained_dir"): "transformers' own error says that a folder's code "
    "needs trust_remote_code only in its text; no attribute carries it (not attnprobe's message)",
}
#: String methods that read the words of a text (taking its first line, or stripping it, reads none).
READING = {
    "split",
    "rsplit",
    "partition",
    "rpartition",
    "startswith",
    "endswith",
    "replace",
    "find",
    "rfind",
    "index",
    "rindex",
    "count",
    "removeprefix",
    "removesuffix",
    "lower",
    "upper",
    "casefold",
}
TEXT_FUNCTIONS = {"str", "repr", "format"}


def _is_exception_annotation(node: ast.expr | None) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.endswith(("Error", "Exception"))


class _Reader(ast.NodeVisitor):
    """Finds, per function, where the text of an exception is read: the names bound by ``except ... as NAME`` and
    the parameters annotated as exceptions, their ``str()``/``repr()``/``format()`` (and names assigned from it)
    given to a reading string method, compared with ``in``/``==``, or searched by ``re``."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str, str]] = []  # (line, function, what)
        self.function = "<module>"
        self.exceptions: set[str] = set()
        self.texts: set[str] = set()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        saved = (self.function, self.exceptions, self.texts)
        self.function, self.texts = node.name, set()
        params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        self.exceptions = {a.arg for a in params if _is_exception_annotation(a.annotation)}
        self.generic_visit(node)
        self.function, self.exceptions, self.texts = saved

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.exceptions = self.exceptions | {node.name}
        self.generic_visit(node)

    def _is_text(self, node: ast.AST) -> bool:
        """An exception's text, or a text derived from it by string methods (``str(exc).strip()``)."""
        if isinstance(node, ast.Name):
            return node.id in self.texts
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in TEXT_FUNCTIONS:
            return any(isinstance(a, ast.Name) and a.id in self.exceptions for a in node.args)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return self._is_text(node.func.value)
        if isinstance(node, ast.Subscript):
            return self._is_text(node.value)
        return False

    def visit_Assign(self, node: ast.Assign) -> None:
        if self._is_text(node.value):
            self.texts |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in READING and self._is_text(func.value):
            self.found.append((node.lineno, self.function, f".{func.attr}() of an exception's text"))
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "re"
            and any(self._is_text(a) for a in node.args)
        ):
            self.found.append((node.lineno, self.function, f"re.{func.attr}() over an exception's text"))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        reading = (ast.In, ast.NotIn, ast.Eq, ast.NotEq)
        if any(isinstance(op, reading) for op in node.ops) and any(
            self._is_text(x) for x in (node.left, *node.comparators)
        ):
            self.found.append((node.lineno, self.function, "an exception's text compared or searched"))
        self.generic_visit(node)


def text_readings(source: str) -> list[tuple[int, str, str]]:
    """(line, function, what) for every place ``source`` reads the text of an exception."""
    reader = _Reader()
    reader.visit(ast.parse(source))
    return reader.found


def test_the_command_line_reads_no_exception_text():
    found = []
    for path in COMMAND_LINE:
        rel = path.relative_to(ROOT).as_posix()
        for line, function, what in text_readings(path.read_text()):
            if (rel, function) not in ALLOWED:
                found.append(f"{rel}:{line} {function}: {what}")
    assert found == []


def test_the_allowed_readings_are_still_there():
    # an entry whose reading is gone (or renamed) must leave the list
    for rel, function in ALLOWED:
        readings = text_readings((ROOT / rel).read_text())
        assert any(f == function for _, f, _ in readings), (rel, function)


PLANTED = {
    # the command line before errors carried their data
    "split": """
def run_capture(work):
    try:
        run(work)
    except CaptureBudgetError as exc:
        what = str(exc).split(". Select", 1)[0]
        raise UsageProblem(f"{what}; select fewer layers")
""",
    "startswith": """
def run_capture(work):
    try:
        run(work)
    except UnsupportedModelError as exc:
        if not str(exc).startswith("no attention found"):
            raise
""",
    "replace on a parameter": """
def cli_selection_message(exc: Exception, model) -> str:
    text = (
        str(exc)
        .replace("attnprobe.attention_modules(model) lists them", "`attnprobe info` lists them")
        .replace("modules=:", "--modules:")
    )
    return text
""",
    "in, through a name": """
def cli_selection_message(exc: SelectionError, model) -> str:
    text = str(exc)
    if "is not a module" in text:
        return text + "; candidates"
    return text
""",
    "a nested handler, re": """
import re
def f():
    try:
        g()
    except OSError as error:
        if re.search("overwrite=True", format(error)):
            pass
""",
    "equality": """
def f():
    try:
        g()
    except ValueError as e:
        return str(e) == "empty"
""",
}

CLEAN = {
    "shown as it is": """
def f():
    try:
        g()
    except ValueError as exc:
        raise UsageProblem(str(exc)) from None
""",
    "its first line": """
def f():
    try:
        g()
    except ValueError as exc:
        raise UsageProblem(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
""",
    "an f-string": """
def f():
    try:
        g()
    except ValueError as exc:
        echo(f"attnprobe: internal error: {type(exc).__name__}: {exc}")
""",
    "its attributes": """
def message(exc: SelectionError) -> str:
    if exc.argument == "modules" and exc.problem is not None:
        return f"--modules: {exc.problem}"
    return str(exc)
""",
    "user input, not an exception": """
def f(names):
    return [n for n in names if n.startswith("lint_")]
""",
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_the_checker_finds_planted_readings(name):
    assert text_readings(PLANTED[name]), name


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_the_checker_leaves_formatting_alone(name):
    assert text_readings(CLEAN[name]) == [], name

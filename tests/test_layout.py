"""The layout docs/architecture.md describes, kept: few modules beside the packages, a loop that reads in one sitting,
functions short enough to see whole, and faces that only re-export. The layers themselves are import-linter's
(`make lint`)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmtune"


def functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_is_longer_than_60_lines():
    long = [
        f"{path.relative_to(PACKAGE)}:{fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for fn in functions(ast.parse(path.read_text()))
        if fn.end_lineno - fn.lineno + 1 > 60
    ]
    assert long == []


def test_the_loop_reads_in_one_sitting_and_the_top_level_holds_the_ground_alone():
    assert len((PACKAGE / "run" / "loop.py").read_text().splitlines()) <= 300
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 6, modules


def test_each_package_face_only_re_exports():
    """An `__init__.py` holds a docstring, imports and `__all__` (or, lazily, a table of exports and the module
    `__getattr__` that imports them on first use, as llmtune.data's): nothing that decides or computes."""
    for init in sorted(PACKAGE.rglob("__init__.py")):
        for node in ast.parse(init.read_text()).body:
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            table = isinstance(node, ast.Assign) and [t.id for t in node.targets] in (["__all__"], ["_EXPORTS"])
            lazy = isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__")
            imports = isinstance(node, (ast.Import, ast.ImportFrom))
            assert docstring or table or lazy or imports, f"{init.relative_to(PACKAGE)}:{node.lineno}"

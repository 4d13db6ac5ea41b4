"""The test suite's own layout: helpers live in tests/support, and no test module imports
another (what two test modules share belongs in tests/support)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def _imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, absolute (relative imports resolved)."""
    package = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
    return names


def _is_test_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "tests" and any(
        part.startswith("test_") or part == "conftest" for part in parts[1:]
    )


def test_no_test_module_imports_another_test_module_or_a_conftest() -> None:
    modules = [
        *TESTS.glob("test_*.py"),
        *TESTS.glob("inprocess/*.py"),
        *TESTS.glob("support/*.py"),
        TESTS / "screenshots.py",
        TESTS / "dashboard.py",
    ]
    assert len(modules) > 40, "the layout test no longer finds the test modules"
    offenders = {
        str(path.relative_to(TESTS.parent)): imported
        for path in modules
        if (imported := sorted({n for n in _imported_modules(path) if _is_test_module(n)}))
    }
    assert not offenders, f"import these from tests/support instead: {offenders}"

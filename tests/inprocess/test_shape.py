"""The project's shape (issue 26, after issue 13's line limit): what matters is which way
imports go, that objects keep out of each other's private state, and that no function of
the product does more than one screen can show (issue 47), not how long a module is. The
import and SLF rules live in pyproject.toml, where `make lint` reads them too; this runs
them with the suite. (tests/inprocess/test_test_layout.py keeps helpers shared by test
modules in tests/support, once.)"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["wire", "gateway", "engine", "stack"]
LONGEST_FUNCTION = 60
"""Lines of a function, from its ``def`` to its last line, docstring and comments included."""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_imports_follow_the_layer_contracts() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layered = {
        layer.split(".")[0]
        for contract in contracts["contracts"]
        if contract["type"] == "layers"
        for layer in contract["layers"]
    }
    assert layered == {"gateway", "engine"}, "the layer contracts are gone from pyproject"
    lint = _run(
        sys.executable,
        "-c",
        "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())",
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "0 broken" in lint.stdout


def test_no_product_module_touches_another_objects_private_names() -> None:
    check = _run(sys.executable, "-m", "ruff", "check", "--select", "SLF", *PRODUCT)
    assert check.returncode == 0, check.stdout + check.stderr


def long_functions(root: Path) -> list[str]:
    """``path:line name (N lines)`` of every function under ``root`` longer than the limit."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    where = path.relative_to(root.parent)
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_product_function_is_longer_than_60_lines() -> None:
    too_long = [found for package in PRODUCT for found in long_functions(ROOT / package)]
    assert too_long == [], "split these into functions that each do one thing"


def test_the_length_check_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST_FUNCTION))
    (tmp_path / "long.py").write_text(f"def short():\n    pass\n\ndef long():\n{body}\n")
    found = [line.split(" ", 1)[1] for line in long_functions(tmp_path)]
    assert found == [f"long ({LONGEST_FUNCTION + 1} lines)"]

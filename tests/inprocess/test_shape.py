"""The project's shape: which way imports go (every module of the product in a layers
contract, no import loop), that objects keep out of each other's private state, and that
no function of the product does more than one screen can show, not how long a module is.
The import and SLF rules live in pyproject.toml, where `make lint` reads them too; this runs
them with the suite. (tests/inprocess/test_test_layout.py keeps helpers shared by test
modules in tests/support, once.)"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["wire", "gateway", "engine", "stack"]
LONGEST_FUNCTION = 60
"""Lines of a function, from its ``def`` to its last line, docstring and comments included."""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return list(config["contracts"])


def modules_in_no_layer(root: Path, contracts: list[dict[str, Any]]) -> list[str]:
    """The product's modules (under ``root``) that no layers contract places: a layer names
    the module, or the package holding it when that package's modules are not layered
    themselves (a package with a contract of its own must name each module in it). A
    package's ``__init__`` counts as the package; the three root packages only re-export."""
    layers = {
        name.strip()
        for contract in contracts
        if contract["type"] == "layers"
        for layer in contract["layers"]
        for name in layer.replace(":", "|").split("|")
    }
    unplaced = []
    for package in ("wire", "gateway", "engine"):
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            named = [".".join(parts[:depth]) for depth in range(len(parts), 0, -1)]
            nearest = next((prefix for prefix in named if prefix in layers), None)
            inner = nearest is not None and any(n.startswith(nearest + ".") for n in layers)
            if len(parts) > 1 and (nearest is None or (nearest != name and inner)):
                unplaced.append(name)
    return unplaced


def test_every_module_of_the_product_is_in_a_layer() -> None:
    assert modules_in_no_layer(ROOT, _contracts()) == []


def test_the_layer_check_finds_a_module_in_no_layer(tmp_path: Path) -> None:
    for name in ("wire/keys.py", "gateway/core/service.py", "gateway/core/stray.py", "engine/w.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    contracts = [
        {"type": "layers", "layers": ["gateway.core", "engine | wire.keys"]},
        {"type": "layers", "layers": ["gateway.core.service"]},
    ]
    assert modules_in_no_layer(tmp_path, contracts) == ["gateway.core.stray"]


def test_imports_follow_the_layer_contracts() -> None:
    kinds = {contract["type"] for contract in _contracts()}
    assert {"layers", "acyclic_siblings"} <= kinds, "the contracts are gone from pyproject"
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

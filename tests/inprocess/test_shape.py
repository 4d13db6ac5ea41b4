"""The project's shape (issue 26, after issue 13's line limit): what matters is which way
imports go and that objects keep out of each other's private state, not how long a module
is. The rules live in pyproject.toml, where `make lint` reads them too; this runs them with
the suite. (tests/inprocess/test_test_layout.py keeps helpers shared by test modules in
tests/support, once.)"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["wire", "gateway", "engine", "stack"]


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

"""The project's shape (issue 13): no Python module of ours grows past 450 lines. A module
that does is doing more than one thing; split it by concern before it lands."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("wire", "gateway", "engine", "stack", "bench", "tests")
MAX_LINES = 450


def test_no_module_is_longer_than_450_lines() -> None:
    modules = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    assert len(modules) > 120, "the size test no longer finds the project's modules"
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in modules
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"split these by concern (lines): {too_long}"

"""Running a benchmark as a user does, for the tests that run tiny versions of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from stack.processes import ROOT


def run_bench(module: str, out: Path, *args: str, timeout_s: float = 200) -> None:
    """``python -m MODULE --out OUT ARGS`` from the repository's root; it must exit 0 (the
    tail of its stderr is the failure's message)."""
    completed = subprocess.run(
        [sys.executable, "-m", module, "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]

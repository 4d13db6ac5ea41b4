"""wire/runtime.py open_files_to_the_hard_limit: a gateway raises its own limit of open
files (each client connection is one) to the most the system lets it have."""

from __future__ import annotations

import resource
import subprocess
import sys


def test_a_process_started_with_a_low_limit_raises_it_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)
    code = (
        "import resource; from wire.runtime import open_files_to_the_hard_limit as up;"
        "print(up(), resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert shown == f"({low}, {hard}) ({hard}, {hard})", shown

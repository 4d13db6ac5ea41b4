"""Running a benchmark as a user does, for the tests that run tiny versions of them."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from bench.stuck import SIGNAL
from stack.processes import ROOT

STACKS_S = 5.0
"""How long a bench past its time has to print its tasks' stacks."""
LOGS = re.compile(r"process logs in (\S+?);?\s")
STOP_S = 30.0
"""How long it then has to stop its processes (an interrupt: its rig's exits run)."""


def run_bench(module: str, out: Path, *args: str, timeout_s: float = 180) -> None:
    """``python -m MODULE --out OUT ARGS`` from the repository's root; it must exit 0 (the
    tail of its stderr is the failure's message). One that runs past ``timeout_s`` is asked
    where it waits (bench/stuck.py) before it is stopped, and the failure says so: a test's
    own timeout must leave ``timeout_s + STACKS_S + STOP_S`` for that."""
    with subprocess.Popen(
        [sys.executable, "-m", module, "--out", str(out), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as bench:
        try:
            _, stderr = bench.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stderr = stop(bench)
            raise AssertionError(
                f"{module} ran past {timeout_s} s; its stderr:\n{stderr[-8000:]}"
                + process_logs(stderr)
            ) from None
    assert bench.returncode == 0, stderr[-4000:] + process_logs(stderr)


def process_logs(stderr: str, lines: int = 15) -> str:
    """The last ``lines`` of each log in the folder the bench named (``process logs in
    DIR``, bench/rig.py ``run_logs``): what its gateway, worker and engines said."""
    found = LOGS.search(stderr)
    return "" if found is None else "\n" + log_tails(Path(found[1]), lines)


def log_tails(folder: Path, lines: int = 15) -> str:
    """The last ``lines`` of each process log under ``folder``, its request lines left out
    (a failure's message: what the processes said)."""
    tails = []
    for log in sorted(folder.glob("**/*.log")):
        said = log.read_text(errors="replace").splitlines()
        tail = [line[:300] for line in said if "msg='request'" not in line][-lines:]
        tails.append(f"--- {log.name}:\n" + "\n".join(tail))
    return "\n".join(tails)


def stop(bench: subprocess.Popen[str]) -> str:
    """Its stderr after printing its tasks' stacks, then an interrupt (SIGINT: asyncio.run
    cancels the suite, and the rigs stop the processes they started), then a kill."""
    for asked, wait_s in ((SIGNAL, STACKS_S), (signal.SIGINT, STOP_S)):
        bench.send_signal(asked)
        try:
            return bench.communicate(timeout=wait_s)[1]
        except subprocess.TimeoutExpired:
            pass
    bench.kill()
    return bench.communicate()[1]

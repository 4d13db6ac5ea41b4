"""Start the product's processes and wait until they serve (shared by ``make run`` and tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env(env: dict[str, str], root: Path = ROOT) -> dict[str, str]:
    """This process's environment for a child run from ``root`` (this repository's, or
    another revision's checkout: bench/revisions.py), ``env`` added: the root first on
    ``PYTHONPATH``, what was there kept after it (a machine whose packages lie in a folder
    of their own, as the lent GPU's in /tmp/site, docs/bench.md)."""
    path = [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), **env}


def spawn(
    args: list[str],
    env: dict[str, str],
    log_path: Path | None = None,
    *,
    python: str = sys.executable,
    root: Path = ROOT,
) -> subprocess.Popen[bytes]:
    """A Python module run from ``root`` (the repository's), in its own process group (by
    ``python``: another environment's, e.g. one with another vLLM)."""
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - the child keeps a copy
    try:
        return subprocess.Popen(
            [python, *args],
            cwd=root,
            env=child_env(env, root),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
    finally:
        if out is not None:
            out.close()


def gateway(
    port: int,
    env: dict[str, str],
    log_path: Path | None = None,
    *,
    host: str = "127.0.0.1",
    grpc_port: int = 0,
    workers: str = "1",
    root: Path = ROOT,
) -> subprocess.Popen[bytes]:
    """``python -m gateway`` (``root``'s); its gRPC server only with a ``grpc_port`` (the
    default 8001 would clash between the gateways of tests and benchmarks); ``workers``:
    processes."""
    args = ["--host", host, "--port", str(port), "--grpc-port", str(grpc_port)]
    args += ["--workers", workers]
    return spawn(["-m", "gateway", *args], env, log_path, root=root)


def engine(
    backend_args: list[str],
    env: dict[str, str],
    log_path: Path | None = None,
    *,
    python: str = sys.executable,
    root: Path = ROOT,
) -> subprocess.Popen[bytes]:
    return spawn(["-m", "engine", *backend_args], env, log_path, python=python, root=root)


def wait_http(
    url: str,
    process: subprocess.Popen[bytes],
    timeout_s: float,
    expect: int = 200,
    stopped: Callable[[], bool] = lambda: False,
) -> None:
    """Poll ``url`` until it answers ``expect``; fail fast if the process exits; return
    early once ``stopped()`` (a Ctrl-C while it waits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stopped():
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == expect:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code == expect:
                return
        except OSError:
            pass
        time.sleep(0.02)  # a start takes about a second: a coarser poll wastes a tenth of it
    if stopped():
        return
    raise TimeoutError(f"{url} did not answer {expect} within {timeout_s:.0f} s")


def stop(process: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def kill(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL at once, as a crash would."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()

"""Every client example in README.md and docs/api.md runs as written: each
``python`` and ``sh`` code block that talks to the gateway (it names
``http://127.0.0.1:8000``, or the gRPC service's ``127.0.0.1:8001``) runs against the
session's real vLLM stack, with only that address changed to the stack's gateway. Blocks
that are commands to run the project (``make run``, ``make bench``) are not client examples
and are not run here.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from tests.support.stack import Gateway, VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = "http://127.0.0.1:8000"
DOCUMENTED_GRPC = "127.0.0.1:8001"
BLOCK = re.compile(r"^```(python|sh)\n(.*?)^```", re.MULTILINE | re.DOTALL)
STREAM_LIMIT_S = 90
"""A shell example that follows a session's event stream (curl -N) reads until it is
stopped, as a person would stop it once the reply has ended: it is stopped when it has
shown the reply's end (``event: done``), and fails if it has not within this long."""
STREAM_END = "event: done"
ENDS_ITSELF = "until="
"""A stream asked to end after one reply (``events?until=<generation_id>``): the example
must end by itself, its reply's end shown, within ``STREAM_LIMIT_S``."""
SAYS = {"hf.chat_completion(": "Paris"}
"""What an example whose code holds the key must print: a first output that looks right
(greedy, so the same every run), where the README's first huggingface_hub example printed
"-and-go-to-the-party-party-party" (a raw prompt, continued greedily)."""


def examples() -> list[tuple[str, str, str]]:
    found = []
    for path in (ROOT / "README.md", ROOT / "docs" / "api.md"):
        text = path.read_text()
        for match in BLOCK.finditer(text):
            if DOCUMENTED in match.group(2) or DOCUMENTED_GRPC in match.group(2):
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{path.name}:{line}", match.group(1), match.group(2)))
    return found


EXAMPLES = examples()


def test_the_docs_have_client_examples_in_both_languages() -> None:
    assert {language for _, language, _ in EXAMPLES} == {"python", "sh"}
    assert len(EXAMPLES) >= 6, [where for where, _, _ in EXAMPLES]


@pytest.fixture(scope="module")
def grpc_gateway(vllm_stack: VllmStack) -> Gateway:
    """A gateway of the vLLM stack that also serves gRPC (the stack's own does not)."""
    return vllm_stack.stack.gateway(grpc=True)


@pytest.mark.parametrize(("where", "language", "code"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_the_example_runs_as_written(
    vllm_stack: VllmStack,
    grpc_gateway: Gateway,
    where: str,
    language: str,
    code: str,
    tmp_path: Path,
) -> None:
    code = code.replace(DOCUMENTED, vllm_stack.gateway.url)
    code = code.replace(DOCUMENTED_GRPC, grpc_gateway.grpc_url)
    if language == "python":
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600
        )
        returncode, printed, errors = done.returncode, done.stdout, done.stderr
    else:
        stopped, returncode, printed, errors = run_shell(code, tmp_path)
        if ENDS_ITSELF in code:
            assert not stopped and STREAM_END in printed, f"{where}:\n{printed}{errors}"
        elif stopped:  # an endless event stream, stopped once it showed the reply's end
            return
    assert returncode == 0, f"{where} failed:\n{printed}{errors}"
    assert printed.strip(), f"{where} printed nothing"
    print(f"\n{where} printed: {printed.strip()[:240]!r}")
    for marker, said in SAYS.items():
        if marker in code:
            assert said in printed, f"{where} printed {printed!r}"


def run_shell(code: str, cwd: Path) -> tuple[bool, int, str, str]:
    """Run a shell example: whether it was stopped at its stream's end (it reads on until
    stopped), its exit status, its stdout and its stderr. Fails if it neither ends nor shows
    its stream's end (one that asks to end by itself: ends) within ``STREAM_LIMIT_S``."""
    with tempfile.TemporaryFile("w+") as errors:
        stopped, returncode, printed = _follow(code, cwd, errors, ENDS_ITSELF not in code)
        errors.seek(0)
        return stopped, returncode, printed, errors.read()


def _follow(code: str, cwd: Path, errors: IO[str], stop_at_end: bool) -> tuple[bool, int, str]:
    process = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", code],
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        cwd=cwd,
        start_new_session=True,  # its curl goes with it when it is stopped
    )
    assert process.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True)
    reader.start()
    shown: list[str] = []
    deadline = time.monotonic() + STREAM_LIMIT_S
    try:
        while (line := lines.get(timeout=max(0.0, deadline - time.monotonic()))) is not None:
            shown.append(line)
            if stop_at_end and line.startswith(STREAM_END):
                return True, 0, "".join(shown)
    except queue.Empty:
        pytest.fail(f"the stream showed no end in {STREAM_LIMIT_S} s:\n{''.join(shown)}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
        reader.join(timeout=10)
        process.stdout.close()
    return False, process.returncode, "".join(shown)


def _read_lines(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)

"""Every client example in README.md and docs/api.md runs as written (issues 24, 29): each
``python`` and ``sh`` code block that talks to the gateway (it names
``http://127.0.0.1:8000``, or the gRPC service's ``127.0.0.1:8001``) runs against the
session's real vLLM stack, with only that address changed to the stack's gateway. Blocks
that are commands to run the project (``make run``, ``make bench``) are not client examples
and are not run here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stack import Gateway, VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = "http://127.0.0.1:8000"
DOCUMENTED_GRPC = "127.0.0.1:8001"
BLOCK = re.compile(r"^```(python|sh)\n(.*?)^```", re.MULTILINE | re.DOTALL)
STREAM_LIMIT_S = 90
"""A shell example that follows a session's event stream (curl -N) reads until it is
stopped, as a person would stop it: it runs this long and must have shown the reply's end."""


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
        command = [sys.executable, "-c", code]
    else:
        command = ["timeout", str(STREAM_LIMIT_S), "bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    output = done.stdout + done.stderr
    if language == "sh" and done.returncode == 124:  # an endless event stream, stopped
        assert "event: done" in done.stdout, f"{where}: the stream showed no end\n{output}"
        return
    assert done.returncode == 0, f"{where} failed:\n{output}"
    assert done.stdout.strip(), f"{where} printed nothing"

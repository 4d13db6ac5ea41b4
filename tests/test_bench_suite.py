"""The benchmark suite (bench/) end to end, tiny: real Redis, engine, gateway, reference relay.

It proves the load generator counts every token of every stream in each mode (SSE and
WebSocket through the gateway, SSE through the reference relay, RESP pub/sub straight from
Redis), that the open-stream sweep holds its streams, and that the report and plots are
written. It asserts nothing about speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stack.processes import ROOT

pytestmark = pytest.mark.timeout(300)


def run_bench(out: Path, *args: str) -> dict[str, object]:
    completed = subprocess.run(
        [sys.executable, "-m", "bench", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    results: dict[str, object] = json.loads((out / "results.json").read_text())
    return results


def test_every_mode_delivers_every_token_and_the_report_and_plots_are_written(
    tmp_path: Path,
) -> None:
    results = run_bench(
        tmp_path,
        *("--concurrency", "1", "3", "--rates", "50", "--duration", "1"),
        *("--hold", "30", "--saturation", "2", "3"),
    )
    points = results["points"]
    assert isinstance(points, list)
    assert sorted((p["mode"], p["streams"]) for p in points) == sorted(
        (mode, n) for mode in ("direct", "reference", "gateway", "ws") for n in (1, 3)
    )
    for point in points:
        assert point["failures"] == [], point
        assert point["tokens"] == point["tokens_expected"] == 50 * point["streams"], point
        assert point["complete_readers"] == point["streams"], point
        assert point["ttft_ms"]["p50"] > 0 and point["itl_ms"]["p50"] >= 0, point
        assert point["redis_calls_per_token"] > 0, point
        relay = point["relay_cpu_us_per_token"]
        assert (relay is None) == (point["mode"] == "direct"), point

    saturation = results["saturation"]
    assert isinstance(saturation, list)
    assert [p["mode"] for p in saturation] == ["reference", "reference-spin", "gateway"]
    for point in saturation:
        assert point["readers_per_stream"] == 3
        assert point["tokens"] == point["tokens_expected"] == 2 * 3 * point["max_tokens"], point

    hold = results["hold"]
    assert isinstance(hold, list) and len(hold) == 1
    assert hold[0]["open_streams"] == hold[0]["alive"] == 30
    assert 1 <= hold[0]["gateway_redis_connections"] <= 65
    assert hold[0]["probe"]["tokens"] == hold[0]["probe"]["tokens_expected"]

    report = (tmp_path / "results.md").read_text()
    assert "## Targets (issue 8)" in report and "| gateway |" in report
    for name in ("latency.png", "throughput.png", "memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

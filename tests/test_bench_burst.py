"""The burst benchmark (bench/burst.py), tiny: real Redis, worker, gateway and engine alone.

It proves both sides get every token of every stream of a burst, with the prepare cost on
both engines, and that the JSON and the report carry each point's added TTFT, tokens/s
ratio, each round's pair, the client's CPU and both sides' TTFT distributions. It asserts
nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import run_bench

pytestmark = pytest.mark.timeout(240)


def test_a_burst_reaches_both_sides_whole_and_the_report_has_every_column(
    tmp_path: Path,
) -> None:
    run_bench(
        "bench.burst",
        tmp_path,
        *("--streams", "4", "12", "--total-rate", "480", "--tokens", "5", "--rounds", "2"),
        *("--within-s", "0.05", "--prepare-cpu-ms", "0.5"),
    )
    results = json.loads((tmp_path / "burst.json").read_text())
    assert results["settings"]["prepare_cpu_ms"] == 0.5
    assert [p["streams"] for p in results["points"]] == [4, 12]
    for point in results["points"]:
        streams = point["streams"]
        assert point["tokens_per_s_per_stream"] == 480 / streams
        for mode in ("engine", "openai"):
            m = point["modes"][mode]
            assert m["failures"] == [] and not m["timed_out"], m
            assert m["tokens"] == m["tokens_expected"] == 5 * streams * 2, m
            assert m["complete_streams"] == streams * 2, m
            assert m["cpu_utilisation"]["loadgen"] > 0, m
            assert len(point["ttft_ms"][mode]) == streams * 2
        added = point["added"]["openai"]
        assert added["added_ttft_p99_ms"] is not None and added["tokens_per_s_ratio"] > 0
        assert len(point["rounds"]) == 2
    report = (tmp_path / "burst.md").read_text()
    assert "| 12 | 40.0 | gateway | 120/120 |" in report, report
    assert (tmp_path / "burst.png").stat().st_size > 0

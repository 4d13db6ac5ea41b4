"""The benchmark suite (``python -m bench``) end to end, tiny: real Redis, engine, gateway.

It proves the open-stream sweep holds every stream it opened on a bounded number of Redis
connections while its probe gets every token, that the fan-out point counts every token of
every reader of every session, and that the report and the memory plot are written. It
asserts nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import run_bench

pytestmark = pytest.mark.timeout(300)


def test_the_hold_sweep_and_the_fan_out_count_every_stream_and_the_report_is_written(
    tmp_path: Path,
) -> None:
    run_bench(
        "bench",
        tmp_path,
        *("--hold", "30", "--saturation", "2", "3", "--duration", "1"),
        timeout_s=240,
    )
    results = json.loads((tmp_path / "results.json").read_text())

    (hold,) = results["hold"]
    assert hold["open_streams"] == hold["alive"] == 30
    assert 1 <= hold["gateway_redis_connections"] <= 65
    probe = hold["probe"]
    assert probe["failures"] == [] and probe["tokens"] == probe["tokens_expected"] > 0, probe

    fan_out = results["saturation"]
    assert (fan_out["sessions"], fan_out["readers_per_session"]) == (2, 3)
    assert fan_out["failures"] == [] and not fan_out["timed_out"], fan_out
    assert fan_out["tokens"] == fan_out["tokens_expected"] == 2 * 3 * fan_out["max_tokens"]
    assert fan_out["complete_streams"] == 6, fan_out
    assert fan_out["cpu_us_per_token"]["gateway"] > 0, fan_out

    report = (tmp_path / "results.md").read_text()
    assert "## Targets" in report and "| 2 x 3 | " in report
    assert "| 30 | 30 |" in report
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

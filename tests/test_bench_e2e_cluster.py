"""bench.e2e's one-Redis vs cluster comparison (``--cluster 3``), tiny: both rigs deliver
every token of every stream on both paths, and the JSON and the report carry each Redis
server's figures (the cluster's 3 shards, the one Redis). Nothing about speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import run_bench

pytestmark = pytest.mark.timeout(240)


def test_both_backends_deliver_every_token_and_report_every_shard(tmp_path: Path) -> None:
    run_bench(
        "bench.e2e",
        tmp_path,
        *("--no-plot", "--cluster", "3", "--streams", "6", "--tokens", "8"),
        *("--saturation", "0", "0", "--modes", "engine", "session", "openai"),
    )
    results = json.loads((tmp_path / "e2e.json").read_text())
    (point,) = results["points"]
    assert set(point["modes"]) == {"engine", "session", "openai"}
    assert set(point["cluster"]) == {"session", "openai"}  # the engine alone has no Redis
    for backend, modes in (("one Redis", point["modes"]), ("cluster", point["cluster"])):
        for mode in ("session", "openai"):
            m = modes[mode]
            assert m["failures"] == [] and not m["timed_out"], m
            assert m["tokens"] == m["tokens_expected"] == point["max_tokens"] * 6, m
            servers = m["redis_servers"]
            expected = ["redis0", "redis1", "redis2"] if backend == "cluster" else ["redis"]
            assert sorted(servers) == expected
            assert sum(s["events"] for s in servers.values()) >= m["tokens"]
            assert abs(sum(s["share"] for s in servers.values()) - 1) < 0.01
            assert m["cpu_us_per_token"]["redis"] == pytest.approx(
                sum(s["cpu_us_per_token"] for s in servers.values()), abs=0.5
            )
    report = (tmp_path / "e2e.md").read_text()
    assert "## One Redis vs a Redis Cluster of 3 primaries" in report
    assert "| 6 | session | " in report and "redis2 " in report

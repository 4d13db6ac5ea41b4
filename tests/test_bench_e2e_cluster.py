"""The one-Redis vs cluster end-to-end benchmark (bench/e2e_cluster.py), tiny: both rigs
deliver every token of every stream on both paths, and the JSON and the report carry each
Redis server's figures (the cluster's 3 shards, the one Redis). Nothing about speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stack.processes import ROOT

pytestmark = pytest.mark.timeout(240)


def test_both_backends_deliver_every_token_and_report_every_shard(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "bench.e2e_cluster", "--out", str(tmp_path)),
            *("--streams", "6", "--tokens", "8", "--rounds", "1"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads((tmp_path / "e2e_cluster.json").read_text())
    (point,) = results["points"]
    assert set(point["backends"]) == {"one Redis", "cluster"}
    for backend, modes in point["backends"].items():
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
    report = (tmp_path / "e2e_cluster.md").read_text()
    assert "redis2:" in report and "| 6 | session | cluster |" in report

"""The request bench (``python -m bench.requests``) end to end, tiny: real Redis, engine,
gateways. It proves every side answers every request, on new and on kept-alive
connections, a gateway of two processes (``--workers 2``) included, sent from two load
processes to two engine workers, and that each side's CPU per request is read for every
process on its path and for the load generator's processes. It asserts nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import run_bench

pytestmark = pytest.mark.timeout(300)


REQUESTS = 400
"""Per side. The kernel counts a process's CPU in 10 ms ticks: 40 requests cost Redis about
20 ms, two ticks or none (a fresh clone's run once read 0 for it); 400 cost it 20 ticks."""


def test_every_side_answers_every_request_and_its_path_cpu_is_read(tmp_path: Path) -> None:
    run_bench(
        "bench.requests",
        tmp_path,
        *("--requests", str(REQUESTS), "--rounds", "1", "--gateways", "1", "2"),
        *("--load-processes", "2", "--engines", "2"),
    )
    results = json.loads((tmp_path / "requests.json").read_text())
    assert (results["settings"]["load_processes"], results["settings"]["engines"]) == (2, 2)
    sides = results["sides"]
    names = ["engine", "gateway x1", "gateway x2"]
    assert list(sides) == [f"{name}, {kind}" for name in names for kind in ("new", "kept")]
    for name, side in sides.items():
        assert side["requests"] == REQUESTS and side["failed"] == 0, (name, side)
        assert side["ttft_p50_ms"] > 0, (name, side)
        cpu = side["cpu_us_per_request"]
        workers = [p for p in side["path"] if p.startswith("worker")]
        assert all(cpu[p] > 0 for p in side["path"] if p not in workers), (name, side)
        # How the two workers share the queue is theirs to decide: together they work.
        assert not workers or sum(cpu[p] for p in workers) > 0, (name, side)
        # The load processes' CPU, each timing itself, is in the load generator's (its
        # main process only waits). No floor in microseconds: that is the machine's speed
        # (a fast hour's run read 46 us per request for a kept connection's client).
        assert 0 < cpu["loadgen processes"] <= cpu["loadgen"], (name, side)
    assert sides["gateway x2, kept"]["path"][:3] == ["gateway x2", "worker", "worker2"]
    assert sides["engine, new"]["path"] == ["engine"]
    report = (tmp_path / "requests.md").read_text()
    assert "| gateway x2 | kept |" in report and "gateway x2 " in report


def test_a_side_with_a_key_that_has_limits_serves_the_key_with_every_request(
    tmp_path: Path,
) -> None:
    """``--limited-key``: a side through the same gateway whose requests show a key with
    limits (admitted inside SUBMIT on one Redis): every request answered, none refused, and
    the key's usage counts each of them (the warm-up's 50 too)."""
    requests = 100
    run_bench(
        "bench.requests",
        tmp_path,
        *("--requests", str(requests), "--rounds", "1", "--gateways", "1"),
        *("--connections", "kept", "--limited-key"),
    )
    results = json.loads((tmp_path / "requests.json").read_text())
    side = results["sides"]["gateway x1, limited key, kept"]
    assert side["requests"] == requests and side["failed"] == 0, side
    assert results["limited_key_generations"] == requests + 50

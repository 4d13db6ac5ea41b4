"""The Redis cost bench (bench/redis_cost.py), tiny: this checkout's real gateway and engine
worker serve one request while MONITOR records its calls, which a real ``valkey-server``
under callgrind then replays. It proves the calls are found and replayed whole (each new
request read by the take and written by the step: a step that wrote nothing would cost
less than the events' XADDs) and the inner calls' price list is measured. It asserts
nothing about speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.redis_cost import INNER
from tests.support.bench import run_bench

pytestmark = pytest.mark.timeout(300)


def test_one_request_replayed_under_callgrind_costs_each_of_its_calls(tmp_path: Path) -> None:
    run_bench("bench.redis_cost", tmp_path, ".", "--requests", "20", timeout_s=240)
    results = json.loads((tmp_path / "redis-cost.json").read_text())
    (seen,) = results["revisions"].values()
    assert seen["take"] == "FCALL", seen
    per, inner = seen["instructions"], results["inner"]
    assert set(inner) == set(INNER), inner
    assert all(cost > 0 for cost in inner.values()), inner
    xadd = inner["XADD (an event)"]
    # SUBMIT writes its queued event and the request (two XADDs); the step writes the
    # reply's three events (started, the token, done); the take reads the request.
    assert per["submit"] > 2 * xadd and per["step"] > 3 * xadd and per["take"] > 0, per
    assert per["request"] > max(per["submit"], per["step"]), per
    assert "| this checkout" in (tmp_path / "redis-cost.md").read_text()

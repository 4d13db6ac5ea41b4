"""The short seeded chaos run (bench/chaos): a minute of every fault kind under mixed load,
every reply checked, on one Redis with persistence and on a Redis Cluster: processes
killed, stopped and cut off from Redis (the run's fault proxy), Redis crashed, wiped, full
and failed over, the clients of every API. ``make soak`` runs the same for ten minutes.
Every client sends with one of the run's API keys, and each key's usage as Redis counted
it must equal what its clients received (bench/chaos/usage.py). An anomaly here is a bug
to fix at its root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos.faults import KINDS
from bench.chaos.tenants import KEY_PLAN
from stack.processes import ROOT

pytestmark = pytest.mark.timeout(480)


@pytest.mark.parametrize(("redis_kind", "seed"), [("single", 11), ("cluster", 12)])
def test_a_minute_of_faults_under_load_loses_repeats_and_hangs_nothing(
    redis_kind: str, seed: int, tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.chaos",
            "--seed",
            str(seed),
            "--duration-s",
            "60",
            "--clients",
            "16",
            "--redis",
            redis_kind,
            "--out",
            str(out),
            "--logs",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = run.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        run.terminate()  # it stops its fleet first (a kill would leave the processes)
        stdout, stderr = run.communicate(timeout=60)
        pytest.fail(f"the chaos run took over 400 s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    print(stdout[-3000:], stderr[-3000:])
    report = json.loads(out.read_text())
    if anomalies := report["anomalies"]:
        # All of them in the captured output; a short message, so that a failing run's
        # summary (what CI shows last) still has room for the other failures.
        print(json.dumps(anomalies, indent=1)[:20000])
        pytest.fail(f"{len(anomalies)} anomalies, the first: {anomalies[0]['what'][:300]}")
    assert run.returncode == 0
    # The run did what it says: every kind of fault, replies of every client kind, and
    # readers that lived through takeovers and reconnects.
    assert set(report["faults_by_kind"]) == set(KINDS[redis_kind])
    assert set(report["replies_by_kind"]) >= {
        "sse",
        "ws_cancel",
        "openai_stream",
        "openai_whole",
        "responses",
        "sse_slow",
        "tgi",
        "oip",
        "grpc",
    }
    # Load, not speed: the clients kept the fleet busy, some ten replies a loop (cluster
    # seed 12 makes 270 to 320 on two cores); clients that could not get through make few.
    assert report["replies"] >= 10 * report["client_loops"]
    assert report["takeovers_seen"] >= 1 and report["reconnects"] >= 100
    assert report["preemptions"] >= 1  # the full workers of one model stopped replies
    assert report["finals"].get("ws_cancel:cancelled", 0) >= 5
    # Redis lost writes (crashed, wiped, failed over) and its clients were told so, in time
    # (the checker holds every telling to its bound: an anomaly otherwise).
    assert report["losses"], report["fault_log"]
    # Every key's usage as Redis counted it is what its clients received (an anomaly
    # otherwise), and each key served a share of the load; the one with a limit was
    # refused at times and waited those out.
    assert [key["name"] for key in report["usage"]] == [name for name, _, _ in KEY_PLAN]
    for key in report["usage"]:
        assert key["counted"] == key["delivered"], key
        assert key["delivered"]["completion_tokens"] > 0, key
    assert sum(key["refused_by_limits"] for key in report["usage"] if key["limits"]) >= 1

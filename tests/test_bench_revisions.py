"""The benchmark of revisions in turns (bench/revisions.py) and the command ledger
(bench/commands.py), tiny: real Redis, gateways and engine workers of two revisions (this
commit, checked out into a scratch folder, and this checkout as it is). It proves each
revision's processes run from its own folder, every workload answers every request on
every side (a burst's prepare flag given to the worker of a revision that has it), with
the ratios to the baseline and the key's side; and that the ledger puts
each script call on the process that made it. It asserts nothing about speed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from stack.processes import ROOT
from tests.support.bench import run_bench

pytestmark = pytest.mark.timeout(300)

REQUESTS = 300
"""Per turn: enough for Redis's CPU to read more than a few 10 ms ticks."""


def test_two_revisions_in_turns_each_run_from_its_own_folder(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    run_bench(
        "bench.revisions",
        tmp_path,
        *("HEAD", ".", "--rounds", "1", "--requests", str(REQUESTS), "--scratch", str(scratch)),
        *("--workloads", "oneshot", "keyed", "burst"),
        *("--burst", "4", "--burst-tokens", "5", "--total-rate", "200"),
        timeout_s=240,
    )
    results = json.loads((tmp_path / "revisions.json").read_text())
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    head, here = (r["label"] for r in results["settings"]["revisions"])
    folder = scratch / commit[:12]
    assert (folder / "wire" / "lua" / "submit.lua").exists()
    workloads = results["workloads"]
    assert list(workloads) == ["oneshot", "keyed", "burst"]
    for name, workload in workloads.items():
        assert list(workload["sides"]) == [head, here], name
        assert [r["round"] for r in workload["rounds"]] == [1], name
        for label, side in workload["sides"].items():
            assert side["failed"] == 0 and side["rate"] > 0, (name, label, side)
            if name != "burst":  # a burst of four: Redis may spend less than a tick on it
                cpu = side["cpu_us_per_request"]
                assert all(cpu[p] > 0 for p in ("gateway", "worker", "redis")), (name, cpu)
            started = side["processes_from"]
            assert started["engine"] == str(ROOT), started  # the engine alone: the bench's
            expected = folder if label == head else ROOT
            assert started["gateway"] == started["worker"] == str(expected), (label, started)
            prepares = "--prepare-cpu-ms" in started["worker_args"]
            assert prepares == (name == "burst"), (name, started)
        assert set(workload["sides"][here]["vs_baseline"]) == {
            "rate",
            "gateway",
            "worker",
            "redis",
            "path",
        }
    assert workloads["keyed"]["sides"][here]["vs_anonymous"] > 0
    spent = workloads["oneshot"]["sides"][here]["redis_command_us_per_request"]
    assert spent["fcall"] > 0, spent  # Redis's time in each command, its scripts' too
    assert workloads["burst"]["sides"][here]["added_ttft_p99_ms"] is not None
    report = (tmp_path / "revisions.md").read_text()
    assert f"| {head} |" in report and "| engine alone |" in report
    assert (tmp_path / "revisions.png").stat().st_size > 0


def test_the_ledger_puts_each_script_on_the_process_that_called_it(tmp_path: Path) -> None:
    requests = 10
    run_bench("bench.commands", tmp_path, ".", "--requests", str(requests), timeout_s=120)
    results = json.loads((tmp_path / "request-commands-counted.json").read_text())
    (seen,) = results["revisions"].values()
    anonymous = seen["anonymous"]
    assert anonymous["calls"]["gateway"]["FCALL submit"] == 1, anonymous
    assert anonymous["calls"]["worker"]["FCALL emit_step"] == 1, anonymous
    assert anonymous["inside"]["FCALL emit_step"]["XADD"] == 3, anonymous  # started, token, done
    assert "keyed" in seen

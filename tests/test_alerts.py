"""The alerting and recording rules and the dashboard (monitoring/), on a real Prometheus.

promtool checks the rules and runs their unit tests (monitoring/prometheus/rules_test.yml:
each alert on series made up for it). Then Debian's Prometheus scrapes a real gateway and
a real worker with the rules loaded: the recording rules and every dashboard query
evaluate on what they export, a request's trace id comes back as an exemplar, and the
alerts a lost worker raises fire when the worker is killed and clear when one is back.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from stack import processes
from stack.redis_server import free_port
from tests.support.otlp import OtlpReceiver
from tests.support.prometheus import (
    RULES,
    Prometheus,
    dashboard_expressions,
    family,
    metric_names,
    rule_expressions,
)
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(180)

MONITORING = RULES.parent
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
LOST_WORKER_ALERTS = {"TokenspoutWorkerDown", "TokenspoutNoWorkerForModel"}


def promtool(*args: str) -> str:
    assert shutil.which("promtool"), "promtool: install Debian's prometheus (make test does)"
    result = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_rules_and_the_scrape_config_pass_promtool_and_the_rules_their_unit_tests(
    tmp_path: Path,
) -> None:
    assert "SUCCESS: 19 rules found" in promtool("check", "rules", str(RULES))
    assert "SUCCESS" in promtool("test", "rules", str(MONITORING / "rules_test.yml"))
    # compose mounts the rules at /etc/prometheus/rules.yml; checked here where they are
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules.yml"]
    config["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    promtool("check", "config", str(tmp_path / "prometheus.yml"))
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {"tokenspout-gateway", "tokenspout-engine"}  # the `up` alerts name them


def exported_families(*texts: str) -> set[str]:
    """The metric families of ``/metrics`` pages (their ``# TYPE`` lines)."""
    return {
        family(line.split()[2])
        for text in texts
        for line in text.splitlines()
        if line.startswith("# TYPE ")
    }


async def test_a_killed_worker_fires_its_alerts_and_they_clear_when_a_worker_is_back(
    stack: Stack, tmp_path: Path
) -> None:
    metrics_port = free_port()
    with OtlpReceiver() as receiver:
        engine_env = receiver.env("tokenspout-engine")
        worker = stack.synthetic(200, "--metrics-port", str(metrics_port), **engine_env)
        gateway = stack.gateway(
            TOKENSPOUT_WORKER_TIMEOUT_S="2", **receiver.env("tokenspout-gateway")
        )
        targets = {
            "tokenspout-gateway": [gateway.url.removeprefix("http://")],
            "tokenspout-engine": [f"127.0.0.1:{metrics_port}"],
        }
        with Prometheus(tmp_path, targets) as prometheus:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {
                    "model": "synthetic",
                    "messages": [{"role": "user", "content": "trace me"}],
                    "max_tokens": 8,
                    "stream": True,
                }
                headers = {"traceparent": TRACEPARENT}
                url = f"{gateway.url}/v1/chat/completions"
                async with client.stream("POST", url, json=body, headers=headers) as response:
                    assert response.status_code == 200
                    assert response.headers["traceresponse"][3:35] == TRACEPARENT[3:35]
                    await response.aread()
                pages = [
                    (await client.get(f"{gateway.url}/metrics")).text,
                    (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text,
                ]

            # Every metric the rules and the dashboard read is one the processes export.
            read = metric_names(rule_expressions() + dashboard_expressions())
            assert read - exported_families(*pages) == set()

            ttft = 'model:tokenspout_ttft_seconds:p90_5m{model="synthetic"}'
            await prometheus.until(lambda: bool(prometheus.query(ttft)), "the TTFT recording")
            for expr in dashboard_expressions():  # valid PromQL on these series
                prometheus.query(expr)
            # The request's trace is the exemplar of its time-to-first-token bucket.
            exemplar = 'tokenspout_gateway_time_to_first_token_seconds_bucket{model="synthetic"}'
            trace_ids = {e["trace_id"] for e in prometheus.exemplars(exemplar)}
            assert TRACEPARENT[3:35] in trace_ids
            assert prometheus.alerts() == {}

            processes.kill(worker)
            killed = time.monotonic()
            fired_s = await prometheus.until(
                lambda: prometheus.firing() >= LOST_WORKER_ALERTS, "the lost worker's alerts"
            )
            firing = prometheus.firing()
            print(f"\nworker killed -> {sorted(firing)} firing in {fired_s:.1f} s")
            assert firing == LOST_WORKER_ALERTS

            stack.synthetic(200, "--metrics-port", str(metrics_port), **engine_env)
            back = time.monotonic()
            cleared_s = await prometheus.until(
                lambda: prometheus.alerts() == {}, "the alerts' clearing"
            )
            print(
                f"worker back {back - killed:.1f} s after the kill -> alerts cleared in "
                f"{cleared_s:.1f} s; targets {prometheus.targets_up()}"
            )

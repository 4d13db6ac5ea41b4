"""A real Prometheus for tests: Debian's ``prometheus`` package (``make test`` installs it),
scraping a test's gateway and workers with the repository's rules.

The rules are monitoring/prometheus/rules.yml as written, but for their timing: every
group evaluates each second and every alert fires after ``for_s`` (the file's minutes
would make a test wait minutes); the expressions, labels and annotations are the file's.

    with Prometheus(tmp_path, {"tokenspout-gateway": [gw], "tokenspout-engine": [w]}) as prom:
        await prom.until(lambda: prom.firing() == {"TokenspoutWorkerDown"})
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from stack import processes
from stack.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "monitoring" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "tokenspout.json"
_METRIC = re.compile(r"(?<![:\w])(tokenspout_[a-z_]+)")


def fast_rules(for_s: int = 2) -> dict[str, Any]:
    """The repository's rules, each group evaluated every second, each alert after
    ``for_s`` seconds."""
    rules: dict[str, Any] = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = f"{for_s}s"
    return rules


def rule_expressions() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def dashboard_expressions() -> list[str]:
    """Every query of the Grafana dashboard, with Grafana's ``$__rate_interval`` as 1m."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        target["expr"].replace("$__rate_interval", "1m")
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def metric_names(expressions: list[str]) -> set[str]:
    """The tokenspout metrics the expressions read (families: no _bucket, _total ...)."""
    return {family(name) for expr in expressions for name in _METRIC.findall(expr)}


def family(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_total", "_created"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


class Prometheus:
    """``prometheus`` on loopback, scraping ``targets`` (job -> ``host:port`` list) every
    second, with ``fast_rules``; its data in ``folder``, its log in ``folder/prometheus.log``."""

    def __init__(self, folder: Path, targets: dict[str, list[str]], for_s: int = 2) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rules = folder / "rules.yml"
        rules.write_text(yaml.safe_dump(fast_rules(for_s)))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": job, "scrape_timeout": "900ms", "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ],
        }
        self.config = folder / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        log = open(self.folder / "prometheus.log", "ab")
        with log:
            self.process = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--enable-feature=exemplar-storage",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        processes.wait_http(f"{self.url}/-/ready", self.process, 30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            processes.stop(self.process)

    def api(self, path: str, **params: str) -> Any:
        """An HTTP API call's ``data`` (AssertionError naming its error when it fails)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's samples now."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[Any]:
        """A range query's series: each ``{"metric": labels, "values": [[t, "v"], ...]}``."""
        data = self.api("query_range", query=expr, start=str(start), end=str(end), step=str(step_s))
        series: list[Any] = data["result"]
        return series

    def alerts(self) -> dict[str, str]:
        """Each alert's state now (pending or firing), by name."""
        alerts = self.api("alerts")["alerts"]
        return {alert["labels"]["alertname"]: alert["state"] for alert in alerts}

    def firing(self) -> set[str]:
        return {name for name, state in self.alerts().items() if state == "firing"}

    def exemplars(self, expr: str) -> list[dict[str, str]]:
        """The exemplars' labels of the series ``expr`` selects, over the last minute."""
        now = time.time()
        data = self.api("query_exemplars", query=expr, start=str(now - 60), end=str(now))
        return [e["labels"] for series in data for e in series["exemplars"]]

    def targets_up(self) -> dict[str, str]:
        """Each scrape target's health now, by ``job instance``."""
        active = self.api("targets")["activeTargets"]
        return {f"{t['labels']['job']} {t['labels']['instance']}": t["health"] for t in active}

    async def until(self, check: Callable[[], bool], what: str, timeout_s: float = 30) -> float:
        """Seconds until ``check()`` holds; AssertionError naming ``what`` and the alerts
        after ``timeout_s``."""
        began = time.monotonic()
        while not await asyncio.to_thread(check):
            if time.monotonic() - began > timeout_s:
                raise AssertionError(f"{what} not within {timeout_s} s; alerts {self.alerts()}")
            await asyncio.sleep(0.2)
        return time.monotonic() - began

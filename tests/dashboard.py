"""Draw the Grafana dashboard (monitoring/grafana/dashboards/tokenspout.json) as it looks on
a live stack, for docs/operations.md:

    python -m tests.dashboard [--out docs/screenshots/dashboard.png] [--seconds 120]

Grafana's image cannot be had where this project is built (no container registry, no
Debian package), so this draws the dashboard itself: its panels where the JSON places
them, each from its own queries, ranged over a real Prometheus (Debian's) scraping a real
gateway and two synthetic workers under a steady load, one of the workers killed half-way
and started again (its takeovers, its alert). matplotlib draws the lines; the figures are
Prometheus' answers to the dashboard's queries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.report import pyplot, save
from stack import processes
from stack.redis_server import EmbeddedRedis, free_port
from tests.support.prometheus import DASHBOARD, Prometheus
from tests.support.stack import Stack

STEP_S = 2


async def load(url: str, until: float) -> None:
    """Streamed chat completions, a few at a time, until ``until``."""

    async def client(index: int) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            while time.monotonic() < until:
                body = {
                    "model": "synthetic",
                    "messages": [{"role": "user", "content": f"client {index} asks"}],
                    "max_tokens": 20 + 10 * index,
                    "stream": True,
                }
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    await r.aread()
                await asyncio.sleep(0.2)

    await asyncio.gather(*(client(index) for index in range(6)))


async def watch(stack: Stack, folder: Path, seconds: int, out: Path) -> None:
    """A stack under load for ``seconds``, a worker killed at a third and back at two
    thirds, watched by Prometheus; the dashboard drawn from what it saw."""
    ports = [free_port(), free_port()]
    workers = [stack.synthetic(40, "--metrics-port", str(port)) for port in ports]
    gateway = stack.gateway(TOKENSPOUT_WORKER_TIMEOUT_S="2")
    targets = {
        "tokenspout-gateway": [gateway.url.removeprefix("http://")],
        "tokenspout-engine": [f"127.0.0.1:{port}" for port in ports],
    }
    with Prometheus(folder, targets, for_s=5) as prometheus:
        began = time.time()
        traffic = asyncio.create_task(load(gateway.url, time.monotonic() + seconds))
        await asyncio.sleep(seconds / 3)
        processes.kill(workers[0])
        await asyncio.sleep(seconds / 3)
        stack.synthetic(40, "--metrics-port", str(ports[0]))
        await traffic
        draw(prometheus, began, time.time(), out)


def draw(prometheus: Prometheus, began: float, ended: float, out: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    plt = pyplot()
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    fig = plt.figure(figsize=(18, rows * 0.42))
    fig.suptitle(
        "tokenspout dashboard: its panels and queries, drawn by matplotlib from a real "
        "Prometheus (not Grafana)",
        fontsize=11,
    )
    grid = fig.add_gridspec(rows, 24, hspace=4, wspace=1.5)
    for panel in dashboard["panels"]:
        at = panel["gridPos"]
        if panel["type"] == "row":
            ax = fig.add_subplot(grid[at["y"], :])
            ax.axis("off")
            ax.text(0, 0, panel["title"], fontsize=10, fontweight="bold", va="bottom")
            continue
        ax = fig.add_subplot(grid[at["y"] : at["y"] + at["h"] - 1, at["x"] : at["x"] + at["w"]])
        draw_panel(ax, panel, prometheus, began, ended)
    save(fig, out, dpi=80)


def draw_panel(
    ax: Any, panel: dict[str, Any], prometheus: Prometheus, began: float, ended: float
) -> None:
    ax.set_title(panel["title"], fontsize=8)
    ax.tick_params(labelsize=6)
    series = []
    for target in panel["targets"]:
        expr = target["expr"].replace("$__rate_interval", "1m")
        for result in prometheus.query_range(expr, began, ended, STEP_S):
            legend = target["legendFormat"]
            for name, value in result["metric"].items():
                legend = legend.replace("{{" + name + "}}", value)
            points = [(float(t) - began, float(v)) for t, v in result["values"]]
            series.append((legend, points))
    if panel["type"] == "stat":
        ax.axis("off")
        text = "\n".join(f"{legend}: {points[-1][1]:g}" for legend, points in series if points)
        ax.text(0.5, 0.5, text or "no data", ha="center", va="center", fontsize=9)
        return
    for legend, points in series:
        ax.plot([t for t, _ in points], [v for _, v in points], label=legend, linewidth=1)
    ax.set_xlabel("s", fontsize=6)
    if series:
        ax.legend(fontsize=5, loc="upper left")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots/dashboard.png"))
    parser.add_argument("--seconds", type=int, default=120)
    args = parser.parse_args()
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory() as folder:
        stack = Stack(server.url, f"dash-{secrets.token_hex(4)}", Path(folder))
        try:
            asyncio.run(watch(stack, Path(folder), args.seconds, args.out))
        finally:
            stack.stop()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

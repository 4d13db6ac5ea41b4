"""The real compose run's handle and probes: podman-compose on compose.yaml plus the
stand-in override, the project's containers, networks and volumes, and what the test reads
from the running stack (tests/test_compose_up.py; docs/containers.md)."""

from __future__ import annotations

import asyncio
import re
import secrets
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support import standins
from tests.support.http import TERMINAL, Reading
from tests.support.sse import Event

ROOT = standins.ROOT
STANDIN_OVERRIDE = ROOT / "docker" / "standins" / "compose.podman.yaml"
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class ComposeRun:
    project: str
    base: str
    env: dict[str, str]
    log: Path
    timings: dict[str, float] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)
    """The checks passed so far, in order: reported with the timings, pass or fail."""
    grpc_address: str = ""
    """host:port of the proxy's gRPC side."""

    def compose(self, *args: str, timeout: float = 300) -> str:
        command = standins.compose_command(
            "--file", str(STANDIN_OVERRIDE), *args, project=self.project
        )
        began = time.monotonic()
        result = subprocess.run(
            command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        with self.log.open("a") as log:
            log.write(f"$ {' '.join(args)} ({time.monotonic() - began:.1f} s)\n")
            log.write(result.stdout + result.stderr)
        assert result.returncode == 0, (args, result.stdout[-3000:], result.stderr[-3000:])
        return result.stdout

    def passed(self, check: str) -> None:
        self.checks.append(check)

    def podman(self, *args: str, timeout: float = 120) -> str:
        result = standins.podman(*args, check=False, timeout=timeout)
        assert result.returncode == 0, (args, result.stderr[-2000:])
        return result.stdout

    def running(self, container: str) -> bool:
        return self.podman("inspect", "--format", "{{.State.Running}}", container).strip() == "true"

    def containers(self, service: str | None = None) -> list[str]:
        labels = ["--filter", f"label=io.podman.compose.project={self.project}"]
        if service is not None:
            labels += ["--filter", f"label=io.podman.compose.service={service}"]
        names = self.podman("ps", "--all", *labels, "--format", "{{.Names}}")
        return sorted(names.split())

    def remove_extra_replicas(self) -> None:
        """Remove the replicas ``--scale`` added beyond the one compose.yaml declares, and
        the proxy with them: podman-compose turns its ``depends_on`` into podman's
        ``--requires`` on every gateway container, so podman removes none without it."""
        extra = [c for c in self.containers() if int(c.rpartition("_")[2]) > 1]
        if extra:
            self.podman("rm", "--force", "--depend", "--time", "10", *extra, timeout=120)

    def sweep(self) -> None:
        """Whatever a failed run left: every container (dependents with it), then the
        project's networks and volumes; each call bounded in time."""
        for container in self.containers():
            standins.podman("rm", "--force", "--depend", "--time", "0", container, check=False)
        left = self.left_over()
        for network in left["networks"]:
            standins.podman("network", "rm", "--force", network, check=False)
        for volume in left["volumes"]:
            standins.podman("volume", "rm", "--force", volume, check=False)

    def left_over(self) -> dict[str, list[str]]:
        label = f"label=io.podman.compose.project={self.project}"
        networks = self.podman("network", "ls", "--format", "{{.Name}}").split()
        return {
            "containers": self.containers(),
            "networks": [n for n in networks if n.startswith(f"{self.project}_")],
            "volumes": self.podman(
                "volume", "ls", "--filter", label, "--format", "{{.Name}}"
            ).split(),
        }


def free_subnet() -> str:
    """A /24 under 10.89 that no route and no podman network on this machine uses yet."""
    taken = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    taken += standins.podman(
        "network", "ls", "--format", "{{range .Subnets}}{{.Subnet}} {{end}}"
    ).stdout
    for _ in range(200):
        prefix = f"10.89.{secrets.randbelow(200) + 50}"
        if f"{prefix}." not in taken:
            return prefix
    raise RuntimeError("no free 10.89.x.0/24 subnet")


def wait_until(
    check: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5
) -> float:
    """Poll ``check`` until it holds; the seconds it took. Raises after ``timeout_s``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if check():
            return time.monotonic() - began
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


def ready_workers(base: str) -> list[dict[str, Any]]:
    try:
        response = httpx.get(f"{base}/ready", timeout=5)
    except httpx.HTTPError:
        return []
    if response.status_code != 200:
        return []
    workers: list[dict[str, Any]] = response.json()["workers"]
    return workers


def active_streams(run: ComposeRun, container: str) -> float:
    probe = (
        "import urllib.request; print(urllib.request.urlopen("
        "'http://127.0.0.1:8000/metrics', timeout=5).read().decode())"
    )
    metrics = run.podman("exec", container, "python", "-c", probe)
    found = re.search(r"^tokenspout_gateway_active_streams (\S+)$", metrics, re.MULTILINE)
    assert found is not None, metrics[:2000]
    return float(found.group(1))


def open_connections(pid: int, port: int) -> int:
    """Established TCP connections to ``port`` in the network namespace of process ``pid``,
    read on the host from /proc. The proxy opens one connection per request and closes it
    after the response, so while nothing else is asked, the one open is a stream's."""
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if local.endswith(f":{port:04X}") and state == "01":  # 01: ESTABLISHED
                count += 1
    return count


def process_state(pid: int) -> str:
    """A process's command line and signal masks (SigCgt: the signals it has handlers for),
    read on the host: what a signal sent to it will meet."""
    proc = Path(f"/proc/{pid}")
    command = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    masks = [
        line
        for line in proc.joinpath("status").read_text().splitlines()
        if line.startswith(("NSpid", "SigBlk", "SigIgn", "SigCgt"))
    ]
    return f"pid {pid}: {command}; " + "; ".join(masks)


def assert_gap_free(events: list[Event], gid: str) -> None:
    """Ids strictly increasing, token counts strictly increasing (a delta may hold several
    tokens), one final event and nothing after it; a `done` counts every token streamed."""
    ids = [entry_key(e.id) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids
    mine = [e for e in events if e.json().get("generation_id") == gid]
    counts = [e.json()["count"] for e in mine if e.event == "token"]
    assert counts == sorted(counts) and len(set(counts)) == len(counts), counts
    finals = [i for i, e in enumerate(mine) if e.event in TERMINAL]
    assert len(finals) == 1 and finals[0] == len(mine) - 1, [e.event for e in mine]
    if mine[-1].event == "done":
        assert mine[-1].json()["usage"]["completion_tokens"] == counts[-1], mine[-1].data


def entry_key(event_id: str | None) -> tuple[int, int]:
    assert event_id is not None
    millis, _, sequence = event_id.partition("-")
    return int(millis), int(sequence or 0)


async def until_events(reading: Reading, count: int, task: asyncio.Task[Reading]) -> None:
    """Wait until a reader task has ``count`` events (it must still be reading)."""
    async with asyncio.timeout(600):
        while len(reading.events) < count:
            assert not task.done(), task
            await asyncio.sleep(0.05)

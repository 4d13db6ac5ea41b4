"""``/metrics`` for every process of ``python -m gateway --workers N``.

A scrape reaches one process (the kernel picks it), so each answers for all: it serves its
own registry on a Unix socket, ``DIR/<index>.sock`` in the directory its parent made, and
the process a scrape reaches reads its siblings' there (``SIBLING_TIMEOUT_S`` each: one that
does not answer, while it restarts say, is left out and logged). Every sample carries a
``process`` label (sum over it for the gateway's figure), except the gauges every process
reads from Redis at scrape time (``shared``), which come once, from the process scraped.
Siblings speak OpenMetrics to each other, so their exemplars (a request's trace id on a
latency bucket) reach a scrape that asks for OpenMetrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client import generate_latest as text_exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics import parser
from prometheus_client.registry import Collector

log = logging.getLogger("tokenspout.metrics")

SIBLING_TIMEOUT_S = 1.0


def openmetrics_exposition(registry: CollectorRegistry) -> bytes:
    """The registry in OpenMetrics (prometheus_client's OpenMetrics functions have no types)."""
    text: bytes = openmetrics.generate_latest(registry)  # type: ignore[no-untyped-call]
    return text


def openmetrics_families(text: str) -> Iterable[Metric]:
    families: Iterable[Metric] = parser.text_string_to_metric_families(text)  # type: ignore[no-untyped-call]
    return families


def peer_socket(directory: Path, index: int) -> Path:
    """Where process ``index`` serves its registry: there once its start-up is done."""
    return directory / f"{index}.sock"


class MetricsPeers:
    """One process's place among its siblings: serves its registry, gathers theirs."""

    def __init__(
        self, directory: Path, index: int, registry: CollectorRegistry, shared: frozenset[str]
    ) -> None:
        self.directory = directory
        self.index = index
        self.registry = registry
        self.shared = shared
        self.path = peer_socket(directory, index)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)  # left by this index's previous process
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.path.unlink(missing_ok=True)

    async def _serve(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.closing(writer):
            writer.write(openmetrics_exposition(self.registry))
            await writer.drain()

    async def exposition(self, openmetrics: bool = False) -> bytes:
        """Every process's samples, labelled by process (in OpenMetrics, or Prometheus'
        text format)."""
        texts = {self.index: openmetrics_exposition(self.registry).decode()}
        siblings = [p for p in sorted(self.directory.glob("*.sock")) if p != self.path]
        for path, text in zip(siblings, await asyncio.gather(*map(read, siblings)), strict=True):
            if text is not None:
                texts[int(path.stem)] = text
        return merged(texts, self.index, self.shared, openmetrics)


async def read(path: Path) -> str | None:
    """A sibling's exposition; None (logged) if it does not answer in time."""
    try:
        async with asyncio.timeout(SIBLING_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(str(path))
            with contextlib.closing(writer):
                return (await reader.read()).decode()
    except (OSError, TimeoutError) as exc:
        extra = {"peer": path.stem, "error": str(exc)}
        log.warning("a gateway process's metrics are missing", extra=extra)
        return None


def merged(
    texts: dict[int, str], own: int, shared: frozenset[str], openmetrics: bool = False
) -> bytes:
    """One exposition of every process's families (``texts``: OpenMetrics), each sample
    labelled with its process; the ``shared`` families once, from process ``own``."""
    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in openmetrics_families(text):
            if family.name in shared:
                if index == own:
                    families[family.name] = family
                continue
            into = families.setdefault(family.name, family)
            process = {"process": str(index)}
            labelled = [s._replace(labels=s.labels | process) for s in family.samples]
            into.samples = labelled if into is family else [*into.samples, *labelled]
    registry = _registry_of(families.values())
    return openmetrics_exposition(registry) if openmetrics else text_exposition(registry)


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def _registry_of(families: Iterable[Metric]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return registry

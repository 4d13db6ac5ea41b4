"""One reader of Prometheus ``/metrics`` (the gateway's and the engine worker's)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""Every sample of a scrape, by name and labels."""


def samples_of(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scrape(client: httpx.AsyncClient, url: str) -> Samples:
    response = await client.get(url)
    assert response.status_code == 200, response.text
    # Prometheus's text format, its charset said once (the gateway's said it twice).
    kind = response.headers["content-type"]
    assert kind.startswith("text/plain; version=") and kind.count("charset") == 1, kind
    return samples_of(response.text)


def scrape_blocking(url: str) -> Samples:
    """``scrape`` without an event loop (for ``asyncio.to_thread``)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        return samples_of(response.read().decode())


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample, or None when the scrape has none (a labelled counter not yet counted)."""
    return samples.get((name, frozenset(labels.items())))


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample, which must be there."""
    key = (name, frozenset(labels.items()))
    present = [dict(k[1]) for k in samples if k[0] == name]
    assert key in samples, f"{name}{labels} not among {present}"
    return samples[key]


async def until_sample(
    client: httpx.AsyncClient,
    url: str,
    expected: float,
    name: str,
    what: str,
    timeout_s: float = 20,
    **labels: str,
) -> None:
    """Scrape until the sample equals ``expected``; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while sample(await scrape(client, url), name, **labels) != expected:
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)

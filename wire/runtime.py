"""What a long-running gateway or engine process runs on: the interpreter settings it
applies once started, and a read its concurrent requests share (``shared_read``)."""

from __future__ import annotations

import asyncio
import gc
import resource
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

GC_YOUNG_THRESHOLD = 20_000
"""Allocations between two young-generation collections (CPython's default: 700). Each
token allocates a few dozen short-lived objects; at the default the cyclic collector runs
hundreds of times a second at load, 12-20 % of a process's busy samples (docs/bench.md)."""


def tune_gc() -> None:
    """Freeze what start-up made (imports, the app, a model) out of the collector's sight,
    and collect the young generation less often. Reference counting frees almost every
    object of the token path at once; the collector only has cycles left to find."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def open_files_to_the_hard_limit() -> tuple[int, int]:
    """Raise this process's limit of open files to the most it may have, and return the
    limit before and after. The soft limit is often 1,024, and every client's connection is
    one: a gateway holding a thousand streams (a burst at a GPU's rate) would refuse the
    next connection, though the system allows far more (its processes inherit the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return soft, hard
    return soft, soft


def shared_read(read: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """``read`` as a task that the requests arriving while it is on its way await together
    (each through ``asyncio.shield``, so one that goes away does not cancel it for the
    others). Its error reaches every request awaiting it; it is retrieved here too, so a
    read whose requests all went away is not reported as never retrieved."""
    task = asyncio.ensure_future(read)
    task.add_done_callback(_retrieve)
    return task


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()

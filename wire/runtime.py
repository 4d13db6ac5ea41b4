"""Interpreter settings a long-running gateway or engine process applies once started."""

from __future__ import annotations

import gc

GC_YOUNG_THRESHOLD = 20_000
"""Allocations between two young-generation collections (CPython's default: 700). Each
token allocates a few dozen short-lived objects; at the default the cyclic collector ran
hundreds of times a second at load and was 12-20 % of a process's busy samples."""


def tune_gc() -> None:
    """Freeze what start-up made (imports, the app, a model) out of the collector's sight,
    and collect the young generation less often. Reference counting frees almost every
    object of the token path at once; the collector only has cycles left to find."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)

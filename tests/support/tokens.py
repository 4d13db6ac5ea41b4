"""What every reader checks of a reply's ``token`` events."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def assert_gap_free_tokens(tokens: Iterable[Mapping[str, Any]], before: int = 0) -> int:
    """Each token event adds exactly its own tokens to the count, starting after
    ``before``: no token lost or repeated. An event may carry several tokens (an engine
    step that made more than one, or tokens the worker joined while Redis was behind), so
    the number of events says nothing. Returns the last count."""
    count = before
    for token in tokens:
        count += len(token["token_ids"])
        assert token["count"] == count, f"a token lost or repeated at {token}"
    return count

"""``WatchMarks``: tells workers which sessions this process has readers for.

A worker aborts a generation whose session nobody has marked watched for the abandon grace
(engine/worker.py). Every gateway process marks the sessions its feeds read every third of
the grace; a mark lives four thirds of it, so a generation is abandoned no sooner than the
grace after its last reader left. A reader that resumes in a process not reading its
session yet (one that came back through another gateway) is marked at once: the mark its
old gateway left may be near its end. Those that come together share one pipeline, so the
readers of a gateway that died, all coming back at once, cost a round trip, not a
connection each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from gateway.core.store.sessions import Sessions

log = logging.getLogger("tokenspout.watchdog")

WATCH_BATCH = 256
"""Sessions marked per pipeline: one pipeline for 10,000 open streams would hold the event
loop (packing and parsing every reply) long enough to stall every stream of the process."""


class WatchMarks:
    """The watch marks of one process's readers: all of them every ``interval_s``
    (``refresh_forever``), and a resuming reader's at once (``reader_came``)."""

    def __init__(
        self, sessions: Sessions, watched: Callable[[], list[str]], interval_s: float
    ) -> None:
        self.sessions = sessions
        self.watched = watched
        """The sessions this process's feeds read now (``RelayHub.watched_sessions``)."""
        self.interval_s = interval_s
        self._came: set[str] = set()
        self._flush: asyncio.Future[None] | None = None
        """The pipeline the readers coming now join (None: the next one starts a new one)."""

    async def reader_came(self, session_id: str) -> None:
        """Mark the session watched now, in one pipeline with the readers that come in the
        same turn of the event loop."""
        self._came.add(session_id)
        if self._flush is None:
            self._flush = asyncio.ensure_future(self._mark_came())
        await asyncio.shield(self._flush)

    async def _mark_came(self) -> None:
        await asyncio.sleep(0)  # the readers of this turn of the loop join first
        came, self._came, self._flush = list(self._came), set(), None
        await self._mark(came)

    async def refresh_forever(self) -> None:
        while True:
            await self._mark(self.watched())
            await asyncio.sleep(self.interval_s)

    async def _mark(self, session_ids: list[str]) -> None:
        """Logged, never raised: a mark Redis did not take is made again by the next
        refresh, and a reader's stream goes on meanwhile."""
        try:
            for start in range(0, len(session_ids), WATCH_BATCH):
                await self.sessions.mark_watched(session_ids[start : start + WATCH_BATCH])
        except (RedisError, OSError) as exc:
            log.warning("could not mark %d sessions watched: %s", len(session_ids), exc)
        except Exception:
            log.exception("marking %d sessions watched failed", len(session_ids))

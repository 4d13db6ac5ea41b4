"""The generations this process's readers wait on that no worker has started yet.

The reaper's queue deadline (gateway/watchdog.py) reads the queues, so it cannot end a
request that is in none: on a Redis Cluster, a primary that restarts answers as primary
for its old slots for a moment, takes a request, and drops it when it is demoted. The
generation itself, on its session's slot, stays ``queued``, and its reader would wait
forever. So each process also keeps the deadline where its clients wait: the hub tells
this book of every ``queued`` event its readers get, and of the event that ends the wait
(the generation started or ended), and ``ReaderDeadline`` (gateway/watchdog.py) ends the
ones still waiting past the deadline. Nothing is read from Redis for it unless one is
overdue; it costs the hub a dict operation per event that is not a token.
"""

from __future__ import annotations

from wire import entry_ms


class WaitingGenerations:
    """Session -> its generations seen ``queued`` and not started since, with when they
    were queued (the ``queued`` event's id: Redis's clock, as the reaper's deadline)."""

    __slots__ = ("_queued",)

    def __init__(self) -> None:
        self._queued: dict[str, dict[str, float]] = {}

    def __len__(self) -> int:
        return sum(len(waiting) for waiting in self._queued.values())

    def saw(self, session_id: str, event_type: str, generation_id: str, event_id: str) -> None:
        """An event a reader of the session got (live or read from the stream; the same
        event twice is harmless). Any event but ``queued`` ends the generation's wait."""
        if event_type == "queued":
            queued_at_s = entry_ms(event_id) / 1000
            self._queued.setdefault(session_id, {})[generation_id] = queued_at_s
        elif (waiting := self._queued.get(session_id)) is not None:
            self.settled(session_id, generation_id, waiting)

    def settled(
        self, session_id: str, generation_id: str, waiting: dict[str, float] | None = None
    ) -> None:
        """Forget one: it started, ended, or the deadline has dealt with it."""
        waiting = self._queued.get(session_id) if waiting is None else waiting
        if waiting is not None:
            waiting.pop(generation_id, None)
            if not waiting:
                del self._queued[session_id]

    def unwatched(self, session_id: str) -> None:
        """The session's last reader in this process left: nobody here waits on it."""
        self._queued.pop(session_id, None)

    def queued_before(self, unix_s: float) -> list[tuple[str, str]]:
        """(session, generation) of those queued before ``unix_s``, still waiting."""
        return [
            (session_id, generation_id)
            for session_id, waiting in self._queued.items()
            for generation_id, queued_at_s in waiting.items()
            if queued_at_s < unix_s
        ]

"""The generations this process's readers wait on that no worker has started yet.

The reaper's queue deadline (gateway/recovery/reaper.py) reads the queues, so it cannot
end a request that is in none: on a Redis Cluster a failover can drop a request its primary
acknowledged (replication is asynchronous; docs/reliability.md has the case). The
generation itself, on its session's slot, stays ``queued``, and its reader would wait
forever. So each process also watches where its clients wait: the hub tells this book of
every ``queued`` event its readers get, and of the event that ends the wait (the generation
started or ended), and ``ReaderDeadline`` (gateway/recovery/reader_deadline.py) queues again a
session turn still waiting a few seconds on with nothing waiting in its queue
(gateway/recovery/stranded.py), and ends those still waiting past the deadline. Nothing is
read from Redis for it unless one waits that long; it costs the hub a dict operation per
event that is not a token.
"""

from __future__ import annotations

from wire import entry_ms


class Waiting:
    """One generation a reader waits on."""

    __slots__ = ("queued_at_s", "requeued")

    def __init__(self, queued_at_s: float) -> None:
        self.queued_at_s = queued_at_s
        """When it was queued: the ``queued`` event's id (Redis's clock, as the reaper's)."""
        self.requeued = False
        """Queued again once already (``ReaderDeadline`` does it once)."""


class WaitingGenerations:
    """Session -> its generations seen ``queued`` and not started since."""

    __slots__ = ("_queued", "_quiet")

    def __init__(self) -> None:
        self._queued: dict[str, dict[str, Waiting]] = {}
        self._quiet: set[str] = set()
        """Sessions whose readers heard nothing for a heartbeat: one that resumed after
        its turn's ``queued`` event (``Last-Event-ID``) never saw it, so Redis is asked
        (``ReaderDeadline``) whether the session's generation waits."""

    def __len__(self) -> int:
        return sum(len(waiting) for waiting in self._queued.values())

    def saw(self, session_id: str, event_type: str, generation_id: str, event_id: str) -> None:
        """An event a reader of the session got (live or read from the stream; the same
        event twice is harmless). Any event but ``queued`` ends the generation's wait."""
        if event_type == "queued":
            self.book(session_id, generation_id, entry_ms(event_id) / 1000)
        elif (waiting := self._queued.get(session_id)) is not None:
            self.settled(session_id, generation_id, waiting)

    def book(self, session_id: str, generation_id: str, queued_at_s: float) -> None:
        """It waits, queued at ``queued_at_s`` (unix seconds); booked already: unchanged."""
        of_session = self._queued.setdefault(session_id, {})
        if generation_id not in of_session:
            of_session[generation_id] = Waiting(queued_at_s)

    def went_quiet(self, session_id: str) -> None:
        self._quiet.add(session_id)

    def take_quiet(self) -> list[str]:
        """The sessions gone quiet since the last call."""
        quiet, self._quiet = list(self._quiet), set()
        return quiet

    def settled(
        self, session_id: str, generation_id: str, waiting: dict[str, Waiting] | None = None
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
        self._quiet.discard(session_id)

    def queued_before(
        self, unix_s: float, *, requeued: bool | None = None
    ) -> list[tuple[str, str]]:
        """(session, generation) of those queued before ``unix_s``, still waiting (and
        queued again already, or not yet, if ``requeued`` says which)."""
        return [
            (session_id, generation_id)
            for session_id, waiting in self._queued.items()
            for generation_id, one in waiting.items()
            if one.queued_at_s < unix_s and requeued in (None, one.requeued)
        ]

    def requeued(self, session_id: str, generation_id: str) -> None:
        """It was queued again (or found not to need it): not again."""
        one = self._queued.get(session_id, {}).get(generation_id)
        if one is not None:
            one.requeued = True

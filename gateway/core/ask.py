"""What a client asks of a generation, whatever API it came through: one value.

Each API checks its own request and builds a ``GenerationAsk``; the gateway's service
(gateway/core/service.py) takes it from there: admits it (gateway/core/store/admission.py), queues
``n`` generations, and the submitter turns it into the engine's ``GenerationRequest``.
"""

from __future__ import annotations

import msgspec

from gateway.tenants.caller import Caller
from wire import ChatMessage, SamplingParams, Task, Tools

REWORK_TURNS = ("regenerate", "continue")
"""Session turns with no message of their own: they answer the history as it is."""


class GenerationAsk(msgspec.Struct, frozen=True, kw_only=True):
    caller: Caller
    """Whom it is asked for (its key's tenant), and where its admission leaves the key's
    quota (gateway/tenants/caller.py)."""
    sampling: SamplingParams
    """With the gateway's defaults and limits applied (``GatewayService.sampling``)."""
    model: str | None = None
    """A model name or alias; None: the default model (a session's own, for a message)."""
    messages: list[ChatMessage] | None = None
    """The conversation to continue (a session message: the one user message)."""
    prompt: str | None = None
    """Raw text to continue, for the completion-style APIs (instead of ``messages``)."""
    tools: Tools | None = None
    task: Task = "generate"
    token_ids: list[int] | None = None
    """The ids to detokenize (``task`` ``detokenize``)."""
    n: int = 1
    """How many choices: each a generation of its own, sampled with its own seed."""
    turn: str = ""
    """How a session turn changes the history first (wire/lua/submit.lua): "" a new
    message; ``edit <i>`` its message replaces history message ``i``; ``regenerate`` (no
    message) the last user message is answered again; ``continue`` (no message) the last
    reply is extended."""
    given: frozenset[str] = frozenset()
    """The sampling fields the request set itself: a conversation's settings fill the others
    (a session turn)."""

    @classmethod
    def message_to_session(
        cls,
        caller: Caller,
        content: str,
        sampling: SamplingParams,
        n: int = 1,
        *,
        turn: str = "",
        given: frozenset[str] = frozenset(),
    ) -> GenerationAsk:
        """A session turn's ask: one user message, or none for a turn that answers the
        history again (``regenerate``, ``continue``; ``content`` is not used). The session
        holds the conversation, its model and its settings."""
        messages = [] if turn in REWORK_TURNS else [ChatMessage("user", content)]
        return cls(caller=caller, sampling=sampling, messages=messages, n=n, turn=turn, given=given)

    @property
    def message(self) -> ChatMessage | None:
        """The one message of a session turn's ask (``message_to_session``); None for a
        ``regenerate`` or ``continue``."""
        if self.turn in REWORK_TURNS and not self.messages:
            return None
        if self.messages is None or len(self.messages) != 1:
            raise ValueError("a session turn asks with exactly one message")
        return self.messages[0]


class KeptSession(msgspec.Struct, frozen=True):
    """A one-generation session kept past its request (a stored ``/v1/responses`` one)."""

    ttl_s: int
    meta: dict[str, str]
    """Fields for its meta hash (the response's request, as the adapter stores it)."""
    background: bool = False
    """Workers treat it as read (a ``keep`` key): no abandonment while nobody reads."""

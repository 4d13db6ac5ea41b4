"""What the gateway and the engine share, and all they share: the wire contract between
them, the log format of their processes and how a request's trace crosses between them.
Neither package imports the other; both import this one, which imports neither (the
import-linter contract in pyproject.toml).

- ``wire.messages``: the messages (msgspec Structs, JSON on the wire), versioned;
- ``wire.keys``: every Redis key, from one prefix (the layout is in its docstring);
- ``wire.generations``: the one owner of a generation's transitions (submit, claim and
  emit, cancel, take over, end), over the Lua scripts of ``wire.scripts`` (wire/lua/, one
  typed wrapper each) and the Redis topology (``wire.topology``: one Redis or a cluster);
- ``wire.replies``: Redis replies and stream entry ids, read the same way on both sides;
- ``wire.logs``: one log line format for every process (``key=value``, or JSON);
- ``wire.tracing``: OpenTelemetry's export and the ``traceparent`` a request carries.

The names below are re-exported, so callers write ``wire.Keys``, ``wire.encode(...)``.
"""

from wire.keys import (
    CONSUMER_GROUP,
    DEFAULT_PREFIX,
    MODEL_NAME,
    SHARED_KEY_TTL_S,
    Keys,
    check_model_name,
    lease_name,
    relay_name,
)
from wire.messages import (
    MODEL_DEFAULTS,
    TERMINAL_EVENTS,
    WIRE_VERSION,
    Cancelled,
    CancelReason,
    CancelSignal,
    ChatMessage,
    Done,
    Error,
    FinalEvent,
    GenerationRequest,
    GenerationState,
    Queued,
    Resume,
    Resumed,
    Role,
    SamplingParams,
    SessionEvent,
    Started,
    StructuredOutput,
    Task,
    Token,
    ToolCall,
    ToolCallDelta,
    ToolChoiceMode,
    Tools,
    ToolSpec,
    TopLogprob,
    Usage,
    WorkerInfo,
    concat_optional,
    decode_event,
    decode_final,
    encode,
    event_type,
    final_reason,
    final_state,
)
from wire.replies import (
    StreamEntry,
    entries_of,
    entry_id_key,
    entry_ms,
    just_before,
    read_entries,
    text,
)

__all__ = [
    "CONSUMER_GROUP",
    "DEFAULT_PREFIX",
    "MODEL_DEFAULTS",
    "MODEL_NAME",
    "SHARED_KEY_TTL_S",
    "TERMINAL_EVENTS",
    "WIRE_VERSION",
    "CancelReason",
    "CancelSignal",
    "Cancelled",
    "ChatMessage",
    "Done",
    "Error",
    "FinalEvent",
    "GenerationRequest",
    "GenerationState",
    "Keys",
    "Queued",
    "Resume",
    "Resumed",
    "Role",
    "SamplingParams",
    "SessionEvent",
    "Started",
    "StreamEntry",
    "StructuredOutput",
    "Task",
    "Token",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoiceMode",
    "ToolSpec",
    "Tools",
    "TopLogprob",
    "Usage",
    "WorkerInfo",
    "check_model_name",
    "concat_optional",
    "decode_event",
    "decode_final",
    "encode",
    "entries_of",
    "entry_id_key",
    "entry_ms",
    "event_type",
    "final_reason",
    "final_state",
    "just_before",
    "lease_name",
    "read_entries",
    "relay_name",
    "text",
]

"""The messages between gateway and engine: msgspec Structs, JSON on the wire.

``GenerationRequest`` and ``CancelSignal`` go from gateways to workers, ``WorkerInfo``
describes a live worker, and the session events (``SessionEvent``) are what a client
reads: the stream entry's ``d`` field, and the SSE ``data:``.

Schema evolution: new fields go at the end with defaults; a change that old readers cannot
ignore bumps ``WIRE_VERSION`` and the key prefix (wire/keys.py), so two versions never share
keys. Version 2: the ``resumed`` event and ``GenerationRequest.resume`` (takeover), which a
version-1 gateway could not decode and a version-1 worker would run from the start.
Version 3: structured outputs, ``logit_bias`` and top logprobs in ``SamplingParams`` (a
version-2 worker would ignore them and stream unconstrained text as if it were valid).
Version 4: tenants (``GenerationRequest.tenant``) and a model's queue shared between them
by the tokens each is served (wire/queue.py): a version-3 worker would never see a request
waiting in a tenant's share of the queue; and ``GenerationRequest.continue_final_message``
(a version-3 worker would answer a new reply where the client asked it to extend the last
one).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

WIRE_VERSION = 4
T = TypeVar("T")

Role = Literal["system", "user", "assistant", "tool"]
ToolChoiceMode = Literal["none", "auto", "required", "named"]
Task = Literal["generate", "tokenize", "detokenize"]
GenerationState = Literal["queued", "running", "done", "cancelled", "error"]
CancelReason = Literal["user", "abandoned", "disconnected", "shutdown"]
TERMINAL_EVENTS = frozenset({"done", "cancelled", "error"})


# --- messages -------------------------------------------------------------------------


class ToolCall(msgspec.Struct, frozen=True):
    """A function call an assistant message made (OpenAI's ``tool_calls`` entry)."""

    id: str
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: Role
    content: str
    tool_calls: list[ToolCall] = []
    """An assistant message's function calls (its content may then be empty)."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""


class ToolSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """A function the model may call: OpenAI's ``tools`` entry, as the chat template gets it."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {}
    """Its arguments' JSON schema."""


class Tools(msgspec.Struct, frozen=True, omit_defaults=True):
    """The functions of a chat request and how it may use them."""

    specs: list[ToolSpec]
    choice: ToolChoiceMode = "auto"
    name: str | None = None
    """The function ``named`` forces."""
    parallel: bool = True
    """More than one call in a reply (``parallel_tool_calls``)."""


class StructuredOutput(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A constraint the engine applies while it samples (vLLM's structured outputs): exactly
    one field is set. The gateway checks each one before anything is queued."""

    json: str | None = None
    """A JSON schema, as JSON text: the reply is one JSON value that validates against it."""
    json_object: bool = False
    """Any JSON object (OpenAI's ``response_format: json_object``)."""
    regex: str | None = None
    choice: list[str] | None = None
    """The reply is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF / Lark grammar, as vLLM's backends take it."""

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int | None = None
    stop: list[str] = []
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    """Ask the engine for the logprob of each sampled token (TGI and OpenAI adapters)."""
    # vLLM's extra sampling fields (its OpenAI server takes them; clients send them through
    # the SDK's ``extra_body``). Neutral defaults: an old writer's request means what it did.
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Version 3.
    top_logprobs: int = 0
    """How many most likely alternatives to report beside each sampled token (needs
    ``logprobs``); each ``Token`` then carries ``tokens`` and ``top_logprobs``."""
    logit_bias: dict[int, float] = {}
    """Token id -> bias added to its logit before sampling (OpenAI's -100..100)."""
    structured: StructuredOutput | None = None
    model_defaults: list[str] = []
    """Fields the client left unset (of ``MODEL_DEFAULTS``): a worker takes its model's
    recommended value for each where the model has one (vLLM's ``generation_config.json``,
    as vLLM's own server does), else the value here (the gateway's default)."""

    def for_choice(self, index: int) -> SamplingParams:
        """Choice ``index``'s parameters (a request with ``n`` > 1): its own seed, when
        the request set one, so the choices differ and the same request gives them again."""
        if self.seed is None or index == 0:
            return self
        return msgspec.structs.replace(self, seed=self.seed + index)


MODEL_DEFAULTS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
"""The sampling fields a model's generation config may recommend (vLLM reads them from its
``generation_config.json``)."""


class GenerationRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the gateway queues for an engine worker (``requests`` stream, field ``r``)."""

    generation_id: str
    session_id: str
    params: SamplingParams
    messages: list[ChatMessage] = []
    """Chat input; the engine applies the model's chat template."""
    prompt: str | None = None
    """Raw text input (completions, TGI, OIP): used as-is, no chat template."""
    enqueued_at: float = 0.0
    session_ttl_s: int = 86_400
    """Lifetime the session's keys get when the generation ends (set by the gateway)."""
    events_maxlen: int = 20_000
    """Cap of the session's event stream (the gateway's TOKENSPOUT_EVENTS_MAXLEN)."""
    v: int = WIRE_VERSION
    resume: Resume | None = None
    """Set when the generation was taken over: continue it after what was streamed."""
    tools: Tools | None = None
    """Functions the model may call (chat only): the template renders them, the worker
    turns what the model writes into ``Token.tool_calls`` (engine/tools.py)."""
    task: Task = "generate"
    """``tokenize``: the worker answers ``started`` with the prompt's token ids (chat
    template applied to ``messages``) and ends ``done`` with ``tokenized``, generating
    nothing; ``detokenize``: one ``token`` event with the text of ``token_ids``."""
    token_ids: list[int] = []
    """What ``detokenize`` turns into text."""
    choice: int = 0
    """Which choice of a session's turn it is (a message with ``n`` > 1): only choice 0's
    reply joins the session's history."""
    tenant: str = ""
    """The tenant (API key) the generation serves and is billed to: its model's queue
    shares the engine between tenants by the tokens each is served (docs/tenants.md);
    "": anonymous."""
    continue_final_message: bool = False
    """Version 4. The conversation ends with an assistant message the engine extends (vLLM's
    ``continue_final_message``: no new turn is opened); the reply joins the history as
    that message made longer, not as a message of its own."""
    traceparent: str = ""
    """The W3C ``traceparent`` of the API call that queued it (wire/tracing.py): the worker's
    spans join that trace and its log lines carry its id; "": tracing is off (nothing on
    the wire)."""

    @property
    def continued(self) -> str:
        """The text of the assistant message this request extends ("" for a new reply)."""
        if not self.continue_final_message or not self.messages:
            return ""
        return self.messages[-1].content

    @property
    def engine_request_id(self) -> str:
        """One per epoch: a continuation never clashes with an earlier run still aborting."""
        return f"{self.generation_id}@{self.resume.takeover}" if self.resume else self.generation_id


class Resume(msgspec.Struct, frozen=True):
    """What a generation had streamed when its worker was lost or stopped: the next worker
    runs the prompt plus ``token_ids`` for ``max_tokens - completion_tokens`` more."""

    takeover: int
    """The epoch (1 for the first takeover): only its request may claim the generation."""
    from_worker: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    token_ids: list[int]


class CancelSignal(msgspec.Struct, frozen=True):
    """Broadcast to every worker (``cancels`` stream, field ``c``); the owner aborts."""

    generation_id: str
    session_id: str
    reason: CancelReason = "user"


class WorkerInfo(msgspec.Struct, frozen=True):
    worker_id: str
    backend: str
    model: str
    capacity: int
    running: int
    started_at: float
    aliases: list[str] = []
    """More names the model answers to (``--served-model-name a,b``: ``b``)."""
    max_model_len: int | None = None
    """Longest prompt plus reply in tokens; None: no fixed context (synthetic)."""
    lease_id: int = 0
    """Client id of its lease connection (``lease_name``; engine/lease.py); 0: none."""
    draining: bool = False
    lease_node: str = ""
    """On a cluster, ``host:port`` of the node its lease connection is on (client ids are
    per node); "": the one Redis."""

    @property
    def names(self) -> list[str]:
        return [self.model, *self.aliases]


# --- session events (the stream entry ``d`` field, and the SSE ``data:``) ---------------


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Queued(msgspec.Struct, frozen=True, tag="queued", omit_defaults=True):
    generation_id: str
    choice: int = 0
    """Which of the turn's choices it is (a message with ``n`` > 1)."""


class Started(msgspec.Struct, frozen=True, tag="started", omit_defaults=True):
    generation_id: str
    model: str
    prompt_tokens: int
    prompt_token_ids: list[int] | None = None
    """The prompt's tokens, for a request that only tokenizes (``task``)."""
    choice: int = 0
    """Which of the turn's choices it is (``GenerationRequest.choice``)."""


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One likely token at a position: ``[text, logprob, id]`` on the wire."""

    token: str
    logprob: float
    id: int


class Token(msgspec.Struct, frozen=True, tag="token", omit_defaults=True):
    generation_id: str
    text: str
    """The text delta (may hold more than one token when the engine batched a step)."""
    count: int
    """Completion tokens generated so far, this delta included."""
    token_ids: list[int] = []
    logprobs: list[float] | None = None
    """Each token's logprob, when the request asked for them (``SamplingParams.logprobs``)."""
    tokens: list[str] | None = None
    """Each token's own text, when logprobs were asked for (their concatenation may differ
    from ``text`` where a token is part of a multi-byte character)."""
    top_logprobs: list[list[TopLogprob]] | None = None
    """Per token, the ``SamplingParams.top_logprobs`` most likely tokens, when asked."""
    content: str | None = None
    """With tools: the part of ``text`` that is the reply's content (``text`` stays what
    the model wrote, which a takeover continues); None: all of ``text``."""
    tool_calls: list[ToolCallDelta] | None = None
    """With tools: calls begun or continued in this delta."""

    @property
    def visible(self) -> str:
        """The content delta a client sees."""
        return self.text if self.content is None else self.content


class ToolCallDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """A piece of a function call, as OpenAI streams ``delta.tool_calls``: the first piece
    of call ``index`` has its ``id`` and ``name``, every piece adds to its ``arguments``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


class Done(msgspec.Struct, frozen=True, tag="done"):
    generation_id: str
    finish_reason: str
    usage: Usage


class Cancelled(msgspec.Struct, frozen=True, tag="cancelled"):
    generation_id: str
    reason: CancelReason
    usage: Usage


class Error(msgspec.Struct, frozen=True, tag="error", omit_defaults=True):
    generation_id: str
    code: str
    message: str
    usage: Usage | None = None
    """What the generation had used when it failed, where its writer knows it (a worker's
    own error, a lost worker's reply read back by the reaper): billed to its tenant."""


class Resumed(msgspec.Struct, frozen=True, tag="resumed"):
    """The generation goes on in another worker: its next token follows the last one."""

    generation_id: str
    from_worker: str
    to_worker: str
    completion_tokens: int
    """Tokens streamed before the takeover."""
    takeover: int


SessionEvent = Queued | Started | Token | Done | Cancelled | Error | Resumed
FinalEvent = Done | Cancelled | Error

_event_decoder = msgspec.json.Decoder(SessionEvent)
_encoder = msgspec.json.Encoder()


def event_type(event: SessionEvent) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_event(data: bytes | str) -> SessionEvent:
    event: SessionEvent = _event_decoder.decode(data)
    return event


def final_state(event: FinalEvent) -> GenerationState:
    return "done" if isinstance(event, Done) else event_type(event)  # type: ignore[return-value]


def final_reason(event: FinalEvent) -> str:
    """Why it ended: the finish reason, the cancel's reason, or the error's code."""
    match event:
        case Done():
            return event.finish_reason
        case Cancelled():
            return event.reason
        case Error():
            return event.code
    return ""


_final_decoder = msgspec.json.Decoder(FinalEvent)


def decode_final(data: bytes | str) -> FinalEvent:
    final: FinalEvent = _final_decoder.decode(data)
    return final


def concat_optional(first: list[T] | None, then: list[T] | None) -> list[T] | None:
    """Two consecutive token events' per-token lists (logprobs, texts) as one: None when
    neither carries any (the request did not ask for them)."""
    if first is None and then is None:
        return None
    return [*(first or ()), *(then or ())]

"""The OpenAI API's request and response bodies, as far as tokenspout speaks them.

Requests name every field the adapter knows; any other field is refused with a 400 that
names it (``forbid_unknown_fields``), as OpenAI's own API does. Fields that are known but
not supported beyond their default value are checked in ``asks.py``. vLLM's own extra
sampling fields are known too: clients moving from ``vllm serve`` send them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.core.structured import Guided, ResponseFormat, StructuredOutputsIn

Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
Stop = str | Annotated[list[str], msgspec.Meta(max_length=8)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far (with ``include_usage``)."""


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCallIn(msgspec.Struct):
    name: str
    arguments: str


class ToolCallIn(msgspec.Struct):
    id: str
    function: FunctionCallIn
    type: Literal["function"] = "function"


class MessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionIn(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionIn


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stop: Stop | None = None
    seed: int | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100, le=100)]] | None = None
    # vLLM's extra sampling fields (``extra_body`` in the SDK), as its OpenAI server takes them.
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stop_token_ids: Annotated[list[int], msgspec.Meta(max_length=64)] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    length_penalty: float | None = None
    use_beam_search: bool | None = None
    # Structured outputs: vLLM's field, and the older ``guided_*`` names it replaced.
    structured_outputs: StructuredOutputsIn | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    response_format: ResponseFormat | None = None

    @property
    def guided(self) -> Guided:
        return Guided(
            guided_json=self.guided_json,
            guided_regex=self.guided_regex,
            guided_choice=self.guided_choice,
            guided_grammar=self.guided_grammar,
        )


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[MessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: Annotated[list[ToolIn], msgspec.Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[str]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


# --- answers ---------------------------------------------------------------------------


class UsageOut(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class FunctionCallOut(msgspec.Struct, omit_defaults=True):
    arguments: str = ""
    name: str | None = None


class ToolCallOut(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ToolCallChunk(msgspec.Struct, omit_defaults=True):
    """A piece of a call in ``delta.tool_calls``: its first piece has the id and name."""

    index: int
    function: FunctionCallOut
    id: str | None = None
    type: Literal["function"] | None = None


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageOut | None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    """The model an alias belongs to (vLLM's field; its own name for the model itself)."""
    max_model_len: int | None
    """Longest prompt plus reply in tokens (vLLM's field); None: no fixed context."""


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorOut(msgspec.Struct):
    error: ErrorDetail

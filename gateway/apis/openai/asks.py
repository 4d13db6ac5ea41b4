"""What an OpenAI request asks, checked: a chat completion's or a (legacy) completion's body
as the gateway's one ``GenerationAsk``. Fields that are known but not supported beyond
their default value are refused here, naming the field (``unsupported_parameter``)."""

from __future__ import annotations

from typing import Any

from gateway.apis.openai.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from gateway.core import structured, tools
from gateway.core.ask import GenerationAsk
from gateway.core.errors import BadRequest
from gateway.core.service import GatewayService
from gateway.tenants.caller import Caller
from wire import ChatMessage, Role, SamplingParams, ToolCall, Tools, ToolSpec

ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
OPENAI_NEUTRAL = {"temperature": 1.0}
"""OpenAI's (and vLLM's) temperature for a request that sets none, where the model
recommends none of its own."""
VLLM_FIELDS = (
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
"""vLLM's extra sampling fields that reach the engine as they are (wire.SamplingParams)."""


def _unsupported(field: str, message: str) -> BadRequest:
    return BadRequest(message, code="unsupported_parameter", field=field)


def chat_ask(service: GatewayService, body: ChatCompletionRequest, caller: Caller) -> GenerationAsk:
    """A chat completion's ask for ``caller``: its tools, sampling and messages, checked in
    that order."""
    functions = _chat_tools(body)
    sampling = _chat_sampling(service, body, functions)
    messages = _chat_messages(body, service.settings.max_history_messages)
    return GenerationAsk(
        caller=caller,
        sampling=sampling,
        model=body.model,
        messages=messages,
        tools=functions,
        n=body.n or 1,
    )


def completion_ask(
    service: GatewayService, body: CompletionRequest, caller: Caller
) -> GenerationAsk:
    """A (legacy) completion's ask for ``caller``: its sampling, then its one prompt."""
    if body.echo:
        raise _unsupported("echo", "echo is not supported")
    if body.best_of not in (None, 1):
        raise _unsupported("best_of", "best_of must be 1")
    if body.suffix:
        raise _unsupported("suffix", "suffix is not supported")
    sampling = service.sampling(
        named={"top_logprobs": "logprobs"},
        neutral=OPENAI_NEUTRAL,
        **_sampling(body, body.max_tokens),
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
    )
    prompt = _completion_prompt(body)
    return GenerationAsk(
        caller=caller, sampling=sampling, model=body.model, prompt=prompt, n=body.n or 1
    )


def _logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    if not given:
        return None
    bias = {}
    for key, value in given.items():
        if not key.lstrip("-").isdigit() or int(key) < 0:
            raise BadRequest(f"logit_bias keys must be token ids, not {key!r}", field="logit_bias")
        bias[int(key)] = value
    return bias


def _sampling(body: SamplingFields, max_tokens: int | None) -> dict[str, Any]:
    """The parameters every OpenAI endpoint shares, checked; refuses what is not supported."""
    if body.use_beam_search:
        raise _unsupported("use_beam_search", "beam search is not supported")
    if body.length_penalty not in (None, 1.0):
        # vLLM applies it in beam search only.
        raise _unsupported("length_penalty", "length_penalty must be 1: it applies to beam search")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return {
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": stop,
        "seed": body.seed,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "logit_bias": _logit_bias(body.logit_bias),
        "structured": structured.constraint(
            body.response_format, body.structured_outputs, body.guided
        ),
        **{name: getattr(body, name) for name in VLLM_FIELDS},
    }


def _chat_messages(body: ChatCompletionRequest, max_messages: int) -> list[ChatMessage]:
    if not body.messages:
        raise BadRequest("messages must not be empty", field="messages")
    if len(body.messages) > max_messages:
        raise BadRequest(
            f"messages may hold at most {max_messages} entries "
            "(TOKENSPOUT_MAX_HISTORY_MESSAGES, as a session's history)",
            code="too_many_messages",
            field="messages",
        )
    messages = []
    for index, message in enumerate(body.messages):
        role = ROLES.get(message.role)
        if role is None:
            raise _unsupported(f"messages[{index}].role", f"role {message.role!r} is not supported")
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise _unsupported(f"messages[{index}].content", "only text content is supported")
            content = "".join(part.text or "" for part in content)
        if role == "tool" and not message.tool_call_id:
            raise BadRequest(
                "a tool message needs the tool_call_id it answers",
                field=f"messages[{index}].tool_call_id",
            )
        calls = [
            ToolCall(call.id, call.function.name, call.function.arguments)
            for call in message.tool_calls or ()
        ]
        if calls and role != "assistant":
            raise BadRequest(
                "only assistant messages carry tool_calls", field=f"messages[{index}].tool_calls"
            )
        messages.append(ChatMessage(role, content or "", calls, message.tool_call_id))
    return messages


def _chat_tools(body: ChatCompletionRequest) -> Tools | None:
    specs = [
        ToolSpec(
            tool.function.name, tool.function.description or "", tool.function.parameters or {}
        )
        for tool in body.tools or ()
    ]
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return tools.tools_of(specs, "named", choice.function.name, body.parallel_tool_calls)
    return tools.tools_of(specs, choice, None, body.parallel_tool_calls)


def _chat_sampling(
    service: GatewayService, body: ChatCompletionRequest, functions: Tools | None
) -> SamplingParams:
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", field="top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    shared = _sampling(body, max_tokens)
    forced = tools.constraint(functions)
    if forced is not None:
        if shared["structured"] is not None:
            raise BadRequest(
                "a forced tool call (tool_choice required or named) and a structured output "
                "cannot both constrain the reply",
                code="invalid_tools",
                field="tool_choice",
            )
        shared["structured"] = forced
    return service.sampling(
        named={"max_tokens": "max_completion_tokens"} if body.max_completion_tokens else None,
        neutral=OPENAI_NEUTRAL,
        **shared,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
    )


def _completion_prompt(body: CompletionRequest) -> str:
    if isinstance(body.prompt, str):
        return body.prompt
    if len(body.prompt) != 1:
        raise _unsupported("prompt", "prompt must be one string (batches are not supported)")
    return body.prompt[0]

"""OpenAI Responses API: ``/v1/responses`` and ``/v1/responses/{id}`` (retrieve, resume,
cancel, delete, input items).

A thin adapter over ``StoredResponse`` (gateway/apis/openai/responses/store.py): it
translates the request into a conversation and sampling parameters, and writes the rendered
events as SSE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import anyio
import msgspec
from litestar import Response, Router, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.params import Parameter
from litestar.response import Stream

from gateway.apis.openai.asks import ROLES
from gateway.apis.openai.errors import openai_error
from gateway.apis.openai.responses.events import ResponseRecord
from gateway.apis.openai.responses.store import StoredResponse, now
from gateway.core import structured, tools
from gateway.core.ask import GenerationAsk
from gateway.core.auth import api_key_check
from gateway.core.errors import (
    HANDLED,
    AnyRequest,
    BadRequest,
    EventsLost,
    GatewayError,
    ending_with_error,
)
from gateway.core.service import GatewayService
from gateway.core.walk import Heartbeat
from gateway.tenants.caller import Caller, caller_of
from gateway.transport import sse
from wire import ChatMessage, SamplingParams, ToolCall, Tools, ToolSpec

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputItem(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class FunctionCallIn(msgspec.Struct, forbid_unknown_fields=True):
    """An earlier reply's call, given back as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputIn(msgspec.Struct, forbid_unknown_fields=True):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


INPUT_KINDS: dict[str, type[InputItem | FunctionCallIn | FunctionCallOutputIn]] = {
    "message": InputItem,
    "function_call": FunctionCallIn,
    "function_call_output": FunctionCallOutputIn,
}


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class FunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponseRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    stream: bool = False
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: (
        Annotated[
            dict[
                Annotated[str, msgspec.Meta(max_length=64)],
                Annotated[str, msgspec.Meta(max_length=512)],
            ],
            msgspec.Meta(max_length=16),
        ]
        | None
    ) = None
    """OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512."""
    text: TextConfig | None = None
    include: list[str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    """Accepted and ignored (OpenAI's end-user hint)."""


def _input(
    given: str | list[dict[str, Any]],
) -> list[InputItem | FunctionCallIn | FunctionCallOutputIn]:
    if isinstance(given, str):
        return [InputItem("user", given)]
    parsed = []
    for index, item in enumerate(given):
        kind = INPUT_KINDS.get(str(item.get("type", "message")))
        if kind is None:
            raise BadRequest(
                f"input items of type {item.get('type')!r} are not supported",
                code="unsupported_parameter",
                field=f"input[{index}].type",
            )
        try:
            parsed.append(msgspec.convert(item, kind))
        except msgspec.ValidationError as exc:
            raise BadRequest(f"input[{index}]: {exc}", field=f"input[{index}]") from None
    return parsed


def _items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as items (``GET .../input_items``): messages with ``input_text``
    / ``output_text`` parts, calls and their outputs."""
    items = []
    for index, item in enumerate(_input(given)):
        if not isinstance(item, InputItem):
            shown = msgspec.to_builtins(item)
            items.append({**shown, "id": item.id or f"fc_in{index}", "status": "completed"})
            continue
        if item.role not in ROLES or item.role == "tool":
            raise BadRequest(f"role {item.role!r} is not supported", field=f"input[{index}].role")
        parts = (
            [ContentPart("input_text", item.content)]
            if isinstance(item.content, str)
            else item.content
        )
        kinds = {"input_text", "output_text"}
        if any(part.type not in kinds or part.text is None for part in parts):
            raise BadRequest(
                "only input_text and output_text content is supported",
                code="unsupported_parameter",
                field=f"input[{index}].content",
            )
        items.append(
            {
                "id": item.id or f"msg_in{index}",
                "type": "message",
                "role": item.role,
                "status": "completed",
                "content": [{"type": part.type, "text": part.text} for part in parts],
            }
        )
    return items


def _messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """The items as chat messages: consecutive calls join one assistant message (the one
    just before when it is the assistant's), each output is a ``tool`` message."""
    messages: list[ChatMessage] = []
    for item in items:
        if item["type"] == "function_call":
            call = ToolCall(item["call_id"], item["name"], item["arguments"])
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = ChatMessage("assistant", last.content, [*last.tool_calls, call])
            else:
                messages.append(ChatMessage("assistant", "", [call]))
        elif item["type"] == "function_call_output":
            messages.append(ChatMessage("tool", item["output"], tool_call_id=item["call_id"]))
        else:
            text = "".join(part["text"] for part in item["content"])
            messages.append(ChatMessage(ROLES[item["role"]], text))
    return messages


def _functions(data: ResponseRequest) -> Tools | None:
    specs = [
        ToolSpec(tool.name, tool.description or "", tool.parameters or {})
        for tool in data.tools or ()
    ]
    choice = data.tool_choice
    if isinstance(choice, FunctionChoice):
        return tools.tools_of(specs, "named", choice.name, data.parallel_tool_calls)
    return tools.tools_of(specs, choice, None, data.parallel_tool_calls)


def _text_format(
    text: TextConfig | None,
) -> tuple[dict[str, Any], structured.ResponseFormat | None]:
    form = text.format if text is not None else None
    if form is None or form.type == "text":
        return {"type": "text"}, None
    shown = msgspec.to_builtins(form)
    if form.type == "json_object":
        return shown, structured.ResponseFormat("json_object")
    schema = structured.JsonSchemaFormat(
        form.name or "response", form.schema, form.description, form.strict
    )
    return shown, structured.ResponseFormat("json_schema", schema)


async def _conversation(service: GatewayService, previous_id: str | None) -> list[ChatMessage]:
    """What the previous response continued, and its output (its instructions are not
    carried over, as OpenAI documents)."""
    if previous_id is None:
        return []
    previous = await StoredResponse.find(service, previous_id, "previous_response_id")
    rendered = await previous.snapshot()
    if not rendered.ended:
        raise BadRequest(
            f"response {previous_id!r} has not ended yet",
            code="previous_response_in_progress",
            field="previous_response_id",
        )
    reply = ChatMessage("assistant", rendered.output_text, rendered.tool_calls)
    return [*previous.record.conversation, reply]


def _sse(events: AsyncIterator[list[dict[str, Any]] | Heartbeat]) -> AsyncIterator[bytes]:
    async def frames() -> AsyncIterator[bytes]:
        async for batch in events:
            if isinstance(batch, Heartbeat):
                yield sse.HEARTBEAT
                continue
            yield b"".join(
                sse.frame(msgspec.json.encode(event), event=event["type"]) for event in batch
            )

    return frames()


def _failure_frame(error: GatewayError) -> bytes:
    body = {"type": "error", "code": error.code, "message": error.message, "param": error.field}
    return sse.frame(msgspec.json.encode(body), event="error")


@post("/responses", summary="OpenAI Responses: create a response", status_code=200)
async def create_response(
    service: GatewayService, data: ResponseRequest, request: AnyRequest
) -> Response[dict[str, Any]] | Stream:
    response = await open_response(service, data, caller_of(request.scope))
    heartbeat_s = service.settings.sse_heartbeat_s
    if data.stream:
        return _stream(response, heartbeat_s, starting_after=-1, owner=True)
    if data.background:
        return Response((await response.snapshot()).response())
    rendered = None
    try:
        rendered = await response.wait(heartbeat_s)
    finally:
        await after_owner(response, rendered is not None)
    return Response(rendered.response())


async def open_response(
    service: GatewayService, data: ResponseRequest, caller: Caller
) -> StoredResponse:
    """The request checked, its conversation gathered and its generation queued for
    ``caller``: what every transport of ``POST /v1/responses`` (HTTP, WebSocket mode)
    starts with."""
    functions = _functions(data)
    if data.background and not data.store:
        raise BadRequest("a background response must be stored", field="store")
    want_logprobs = _wants_logprobs(data)
    items = _items(data.input)
    if not items:
        raise BadRequest("input must not be empty", field="input")
    previous = await _conversation(service, data.previous_response_id)
    conversation = [*previous, *_messages(items)]
    max_messages = service.settings.max_history_messages
    if len(conversation) > max_messages:
        raise BadRequest(
            f"the conversation may hold at most {max_messages} messages "
            "(TOKENSPOUT_MAX_HISTORY_MESSAGES, as a session's history)",
            code="too_many_messages",
            field="input",
        )
    shown_format, response_format = _text_format(data.text)
    sampling = _sampling(service, data, functions, response_format, want_logprobs)
    record = _record(data, conversation, items, shown_format, want_logprobs)
    system = [ChatMessage("system", data.instructions)] if data.instructions else []
    ask = GenerationAsk(
        caller=caller,
        sampling=sampling,
        model=data.model or None,
        messages=[*system, *conversation],
        tools=functions,
    )
    return await StoredResponse.create(service, record, ask)


def _wants_logprobs(data: ResponseRequest) -> bool:
    include = set(data.include or ())
    if include - {LOGPROBS_INCLUDE}:
        raise BadRequest(
            f"include supports only {LOGPROBS_INCLUDE!r}",
            code="unsupported_parameter",
            field="include",
        )
    return LOGPROBS_INCLUDE in include


def _sampling(
    service: GatewayService,
    data: ResponseRequest,
    functions: Tools | None,
    response_format: structured.ResponseFormat | None,
    want_logprobs: bool,
) -> SamplingParams:
    forced = tools.constraint(functions)
    if forced is not None and response_format is not None:
        raise BadRequest(
            "a forced function call (tool_choice required or a function) and text.format "
            "cannot both constrain the reply",
            code="invalid_tools",
            field="tool_choice",
        )
    return service.sampling(
        named={"max_tokens": "max_output_tokens"},
        max_tokens=data.max_output_tokens,
        temperature=data.temperature,
        top_p=data.top_p,
        logprobs=want_logprobs or None,
        top_logprobs=data.top_logprobs if want_logprobs else None,
        structured=forced or structured.constraint(response_format),
    )


def _record(
    data: ResponseRequest,
    conversation: list[ChatMessage],
    items: list[dict[str, Any]],
    shown_format: dict[str, Any],
    want_logprobs: bool,
) -> ResponseRecord:
    """What the request was, kept with the response."""
    return ResponseRecord(
        model=data.model or "",
        created_at=now(),
        conversation=conversation,
        input_items=items,
        instructions=data.instructions,
        max_output_tokens=data.max_output_tokens,
        temperature=data.temperature,
        top_p=data.top_p,
        metadata=data.metadata or {},
        background=data.background,
        store=data.store,
        previous_response_id=data.previous_response_id,
        text_format=shown_format,
        logprobs=want_logprobs,
        tools=[msgspec.to_builtins(tool) for tool in data.tools or ()],
        tool_choice=msgspec.to_builtins(data.tool_choice or "auto"),
        parallel_tool_calls=data.parallel_tool_calls is not False,
    )


def _stream(
    response: StoredResponse, heartbeat_s: float, *, starting_after: int, owner: bool
) -> Stream:
    """The events after ``starting_after``. When the creating request's stream (``owner``)
    ends before the response does, a foreground response is cancelled; an unstored one is
    forgotten either way."""
    renderer = response.renderer()

    async def ended() -> None:
        if owner:
            await after_owner(response, renderer.ended)

    events = response.events(heartbeat_s, starting_after, renderer)
    chunks = ending_with_error(_sse(events), _failure_frame)
    return sse.response(chunks, background=BackgroundTask(ended))


async def after_owner(response: StoredResponse, ended: bool) -> None:
    """What follows the creating request: an unstored response is forgotten (stopped if
    it runs), a foreground one whose client left is cancelled."""
    with anyio.CancelScope(shield=True):  # also when the request itself was cancelled
        if not response.record.store:
            await response.delete()
        elif not ended and not response.record.background:
            await response.abandon()


@get("/responses/{response_id:str}", summary="OpenAI Responses: retrieve or resume a response")
async def retrieve_response(
    service: GatewayService,
    response_id: str,
    stream: bool = False,
    starting_after: Annotated[int, Parameter(ge=-1)] = -1,
) -> Response[dict[str, Any]] | Stream:
    response = await StoredResponse.find(service, response_id)
    if stream:
        heartbeat_s = service.settings.sse_heartbeat_s
        if starting_after >= 0:
            await _check_starting_after(response, starting_after)
        return _stream(response, heartbeat_s, starting_after=starting_after, owner=False)
    return Response((await response.snapshot()).response())


async def _check_starting_after(response: StoredResponse, starting_after: int) -> None:
    """A number past the end of a response that has ended is none it ever sent (Redis lost
    its events, or it is not this response's): its stream would say nothing, so it is
    refused at once. Past the events of a running one it is only early: they will come."""
    so_far = await response.snapshot()
    last = so_far.sequence - 1
    if so_far.ended and starting_after > last:
        raise EventsLost(str(starting_after), str(last), field="starting_after")


@post("/responses/{response_id:str}/cancel", summary="OpenAI Responses: cancel", status_code=200)
async def cancel_response(service: GatewayService, response_id: str) -> dict[str, Any]:
    response = await StoredResponse.find(service, response_id)
    if not (await response.snapshot()).ended:
        await response.cancel()
        await service.wait_final(response.session_id, response.generation_id)
    return (await response.snapshot()).response()


@delete("/responses/{response_id:str}", summary="OpenAI Responses: delete", status_code=200)
async def delete_response(service: GatewayService, response_id: str) -> dict[str, Any]:
    response = await StoredResponse.find(service, response_id)
    await response.delete()
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@get("/responses/{response_id:str}/input_items", summary="OpenAI Responses: input items")
async def input_items(
    service: GatewayService,
    response_id: str,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    response = await StoredResponse.find(service, response_id)
    items = list(response.record.input_items)
    if order == "desc":
        items.reverse()
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": False,
    }


responses_router = Router(
    path="/v1",
    route_handlers=[
        create_response,
        retrieve_response,
        cancel_response,
        delete_response,
        input_items,
    ],
    tags=["openai"],
    exception_handlers={kind: openai_error for kind in HANDLED},
    before_request=api_key_check,
)

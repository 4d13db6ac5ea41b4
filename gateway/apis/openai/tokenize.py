"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, in its shapes.

The gateway never loads a model or a tokenizer: each request goes to a worker of the model
the way a generation goes (a stateless session, the model's queue), and the worker answers
with its own tokenizer and chat template, so the ids are exactly those the engine sees.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Router, post

from gateway.apis.openai.routes import ROLES, openai_error
from gateway.core.auth import api_key_check
from gateway.core.errors import HANDLED, BadRequest
from gateway.core.generation_stream import Collected, GenerationStream
from gateway.core.relay import RelayHub
from gateway.core.sessions import SessionStore
from gateway.core.settings import Settings
from wire import ChatMessage, SamplingParams, Task

MAX_TOKEN_IDS = 65_536


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_TOKEN_IDS)
    ]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


def _messages(given: list[dict[str, Any]]) -> list[ChatMessage]:
    messages = []
    for index, message in enumerate(given):
        role, content = ROLES.get(str(message.get("role"))), message.get("content")
        if role is None or not isinstance(content, str):
            raise BadRequest(
                "each message needs a role and text content", field=f"messages[{index}]"
            )
        messages.append(ChatMessage(role, content))
    return messages


async def _ask_worker(
    store: SessionStore,
    hub: RelayHub,
    settings: Settings,
    model: str | None,
    task: Task,
    **given: Any,
) -> Collected:
    params = SamplingParams(max_tokens=1)
    stream = await GenerationStream.submit(
        store, hub, settings, params, model=model, task=task, **given
    )
    return await stream.collect()


@post(
    "/tokenize",
    status_code=200,
    summary="vLLM's tokenize: a prompt or messages as the model's token ids",
)
async def tokenize(
    store: SessionStore,
    hub: RelayHub,
    settings: Settings,
    data: TokenizeRequest,
) -> TokenizeResponse:
    if (data.prompt is None) == (data.messages is None):
        raise BadRequest("give either prompt or messages", field="prompt")
    if data.return_token_strs:
        raise BadRequest("return_token_strs is not supported", field="return_token_strs")
    if data.messages is not None:
        given: dict[str, Any] = {"messages": _messages(data.messages)}
    else:
        given = {"prompt": data.prompt}
    whole = await _ask_worker(store, hub, settings, data.model, "tokenize", **given)
    ids = whole.prompt_token_ids or []
    max_model_len = await store.models.max_model_len(whole.model)
    return TokenizeResponse(len(ids), max_model_len, ids, None)


@post("/detokenize", status_code=200, summary="vLLM's detokenize: token ids as the model's text")
async def detokenize(
    store: SessionStore,
    hub: RelayHub,
    settings: Settings,
    data: DetokenizeRequest,
) -> DetokenizeResponse:
    whole = await _ask_worker(store, hub, settings, data.model, "detokenize", token_ids=data.tokens)
    return DetokenizeResponse(whole.text)


tokenize_router = Router(
    path="/",
    route_handlers=[tokenize, detokenize],
    tags=["vllm"],
    exception_handlers={kind: openai_error for kind in HANDLED},
    before_request=api_key_check,
)

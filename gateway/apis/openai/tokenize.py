"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, in its shapes.

The gateway never loads a model or a tokenizer: each request goes to a worker of the model
the way a generation goes (a stateless session, the model's queue), and the worker answers
with its own tokenizer and chat template, so the ids are exactly those the engine sees.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Router, post

from gateway.apis.openai.asks import ROLES
from gateway.apis.openai.errors import openai_error
from gateway.core.ask import GenerationAsk
from gateway.core.auth import api_key_check
from gateway.core.errors import HANDLED, AnyRequest, BadRequest
from gateway.core.generation_stream import Collected
from gateway.core.service import GatewayService
from gateway.tenants.caller import caller_of
from wire import ChatMessage, SamplingParams

MAX_TOKEN_IDS = 65_536
ONE_TOKEN = SamplingParams(max_tokens=1)
"""A tokenizer task samples nothing; its request still carries parameters."""


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


async def _ask_worker(service: GatewayService, ask: GenerationAsk) -> Collected:
    """The ask's one generation, whole: the worker answers a tokenizer task as one."""
    (whole,) = await (await service.generate(ask)).collect()
    return whole


@post(
    "/tokenize",
    status_code=200,
    summary="vLLM's tokenize: a prompt or messages as the model's token ids",
)
async def tokenize(
    service: GatewayService, data: TokenizeRequest, request: AnyRequest
) -> TokenizeResponse:
    if (data.prompt is None) == (data.messages is None):
        raise BadRequest("give either prompt or messages", field="prompt")
    if data.return_token_strs:
        raise BadRequest("return_token_strs is not supported", field="return_token_strs")
    messages = _messages(data.messages) if data.messages is not None else None
    ask = GenerationAsk(
        caller=caller_of(request.scope),
        sampling=ONE_TOKEN,
        model=data.model,
        messages=messages,
        prompt=data.prompt,
        task="tokenize",
    )
    whole = await _ask_worker(service, ask)
    ids = whole.prompt_token_ids or []
    max_model_len = await service.max_model_len(whole.model)
    return TokenizeResponse(len(ids), max_model_len, ids, None)


@post("/detokenize", status_code=200, summary="vLLM's detokenize: token ids as the model's text")
async def detokenize(
    service: GatewayService, data: DetokenizeRequest, request: AnyRequest
) -> DetokenizeResponse:
    ask = GenerationAsk(
        caller=caller_of(request.scope),
        sampling=ONE_TOKEN,
        model=data.model,
        token_ids=data.tokens,
        task="detokenize",
    )
    whole = await _ask_worker(service, ask)
    return DetokenizeResponse(whole.text)


tokenize_router = Router(
    path="/",
    route_handlers=[tokenize, detokenize],
    tags=["vllm"],
    exception_handlers={kind: openai_error for kind in HANDLED},
    before_request=api_key_check,
)

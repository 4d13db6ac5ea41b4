"""SUBMIT as a gateway sends a one-shot request on one Redis, with its model's queue: the
requests the in-process tests of the scripts start from."""

from __future__ import annotations

import secrets

import msgspec
import redis.asyncio as aioredis

import wire
from wire import ChatMessage, GenerationRequest, Keys, SamplingParams, prefixes
from wire.limits import Limits
from wire.outcomes import Accepted, Admitted
from wire.queue import RequestQueue, estimated_tokens
from wire.scripts import AdmitInSubmit, NewSession, Submit

MODEL = "m"


class Gateway:
    """SUBMIT as a gateway sends a one-shot request on one Redis, with its queue."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.keys = Keys(f"straight-{secrets.token_hex(3)}")
        self.submit = Submit(redis, self.keys)
        self.queue = RequestQueue(redis, self.keys, MODEL)
        self.redis = redis
        self.sent = 0

    async def send(
        self,
        tenant: str,
        weight: float = 1.0,
        limits: Limits | None = None,
        chat: tuple[str, ...] = (),
    ) -> GenerationRequest:
        """A request of ``tenant``: a prompt, or the ``chat`` of these messages (user,
        assistant, user...), named by its prefixes as the gateway names them."""
        self.sent += 1
        gid, sid = f"g{self.sent}", f"s{self.sent}"
        if chat:
            roles = ("user", "assistant")
            messages = [ChatMessage(roles[i % 2], text) for i, text in enumerate(chat)]
            request = GenerationRequest(gid, sid, SamplingParams(), messages=messages)
        else:
            request = GenerationRequest(gid, sid, SamplingParams(), prompt="hello", tenant=tenant)
        reply = await self.submit.create_admitted(*self.submit_of(request, tenant, weight, limits))
        assert isinstance(reply, Accepted | Admitted), reply
        return request

    def submit_of(
        self, request: GenerationRequest, tenant: str, weight: float, limits: Limits | None
    ) -> tuple[NewSession, AdmitInSubmit]:
        """SUBMIT's arguments for ``request``, admitted in the script as on one Redis."""
        waiting = self.queue.waiting(
            wire.encode(request),
            estimate=estimated_tokens(request),
            tenant=tenant,
            weight=weight,
            prefixes=prefixes.asked(MODEL, request),
        )
        admission = AdmitInSubmit(
            queues=[self.queue.key],
            target=0,
            limit=1000,
            model_limit=0,
            request=waiting.element,
            tenant=waiting.tenant,
            weight=weight,
            stream_cap=1000,
            limits=limits,
        )
        new = NewSession(
            request.session_id, request.generation_id, 100, 60, 60, tenant, "all", limits
        )
        return new, admission

    async def straight(self) -> list[str]:
        """The tenants of the requests that came straight into the stream (no estimate: a
        take moved none of them from a list), oldest first."""
        entries = await self.redis.xrange(self.queue.key)
        return [tenant_of(fields) for _, fields in entries if b"e" not in fields]


async def gateway(redis: aioredis.Redis) -> Gateway:
    made = Gateway(redis)
    await made.queue.ensure_group()
    return made


def tenant_of(fields: dict[bytes, bytes]) -> str:
    return msgspec.json.decode(fields[b"r"], type=GenerationRequest).tenant

"""Admission: the one place an ask is judged before anything of it is written.

What an ask may be (its ``n``), whether the key it serves may use the model, the key's
limits (gateway/tenants/limits.py: a script on the key's slot, exact across gateways) and
the gateway's capacity (``TOKENSPOUT_MAX_INFLIGHT``, per model too) are decided here, and
each admission answers a ``Ticket``: what the submit consumes, or gives back should it not
go through. Where one node holds every key (``Topology.one_node``), a one-shot request is
admitted by the SUBMIT script itself, in the call that queues it (one round trip, atomic
across gateways): its ticket carries what SUBMIT checks (``wire.scripts.AdmitInSubmit``)
and reads its answer (``Ticket.settled``). Elsewhere, and for a session turn, the checks
come first and the ticket gives back what they took if the submit fails.

The key's counts after an admission become the response's ``x-ratelimit-*`` headers: the
ticket leaves them on the request's ``Caller`` (gateway/tenants/caller.py), whose headers
the outermost layer writes.

    admission.check(ask)                                            # 400
    ticket = await admission.one_shot(ask.caller, ask.model, model, request, kept=False)  # 403
    try:
        reply = ticket.settled(await submit(ticket.in_submit))      # 429, the quota
    except BaseException:
        await ticket.give_back()
        raise
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol

import anyio
import redis.asyncio as aioredis

from gateway.core.ask import GenerationAsk
from gateway.core.errors import (
    AGAIN_AFTER_S,
    BadRequest,
    Forbidden,
    Overloaded,
    RateLimited,
    Unauthorized,
    keys_not_loaded,
)
from gateway.core.settings import Settings
from gateway.core.store.queue import GenerationQueue, QueueCounts
from gateway.tenants.caller import Caller
from gateway.tenants.directory import TenantDirectory
from gateway.tenants.limits import LimitReached, TenantLimits
from gateway.tenants.records import ANONYMOUS, Tenant
from wire import GenerationRequest, Keys
from wire.limits import Counts, Limits
from wire.outcomes import Accepted, Admitted, Limited, OverCapacity, SubmitReply
from wire.runtime import shared_read
from wire.scripts import AdmitInSubmit


class AdmissionObserver(Protocol):
    """Told of each admission and refusal, by key (gateway/server/metrics.py)."""

    def admitted(self, key: str) -> None: ...

    def refused(self, key: str, limit: str) -> None: ...


class CountsRead:
    """One read of the queue counts, on its way or done, that the capacity checks arriving
    while it is on its way share; ``admitted``: the generations they let in, per model."""

    __slots__ = ("admitted", "models", "task")

    def __init__(self, models: list[str], read: Coroutine[Any, Any, QueueCounts]) -> None:
        self.models = models
        self.task = shared_read(read)
        self.admitted: dict[str, int] = {}


class Ticket:
    """What one admission took: given back should its submit not go through, or (taken by
    SUBMIT itself) settled from SUBMIT's answer."""

    __slots__ = (
        "_admission",
        "caller",
        "count_request",
        "generation_ids",
        "in_submit",
        "model",
        "taken",
        "tenant",
    )

    def __init__(
        self,
        admission: Admission,
        caller: Caller,
        tenant: Tenant,
        model: str,
        generation_ids: Sequence[str],
        *,
        count_request: bool = True,
        taken: bool = False,
        in_submit: AdmitInSubmit | None = None,
    ) -> None:
        self._admission = admission
        self.caller = caller
        """Whose response carries the key's quota."""
        self.tenant = tenant
        """Whose limits admitted it (a session turn's: the session's key)."""
        self.model = model
        self.generation_ids = generation_ids
        self.count_request = count_request
        """False for another choice of a request counted already."""
        self.taken = taken
        """The key's limits took the generations before the submit (a round trip of its
        own): given back if it fails."""
        self.in_submit = in_submit
        """What SUBMIT admits in the call that queues (None: admitted before)."""

    async def give_back(self, generation_ids: Sequence[str] | None = None) -> None:
        """What the key's admission took (of ``generation_ids``; None: all of them), for
        generations that were not queued after all; given back even when the request is
        being cancelled (its client left)."""
        if not self.taken:
            return
        count_request = self.count_request and generation_ids is None
        with anyio.CancelScope(shield=True):
            await self._admission.limits.release(
                self.tenant, generation_ids or self.generation_ids, count_request=count_request
            )

    def settled(self, reply: SubmitReply) -> SubmitReply:
        """SUBMIT's answer read as an admission: 429 past the capacity (or, admitted by
        SUBMIT itself, a limit of the key); the key's quota left for the response's
        headers."""
        if isinstance(reply, OverCapacity):
            raise self._admission.overloaded(reply, self.model)
        if self.in_submit is None:
            return reply
        counts = reply.counts if isinstance(reply, Admitted | Limited) else None
        self._admission.settle(self.caller, self.tenant, counts, count_request=self.count_request)
        return Accepted(reply.queued_id, []) if isinstance(reply, Admitted) else reply


class Admission:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        directory: TenantDirectory,
        queue: GenerationQueue,
        *,
        one_node: bool,
        observer: AdmissionObserver | None = None,
    ) -> None:
        """``one_node``: SUBMIT can admit a one-shot request itself (``Topology``)."""
        self.settings = settings
        self.directory = directory
        self.queue = queue
        self.one_node = one_node
        self.observer = observer
        self.limits = TenantLimits(redis, keys)
        self._idempotency = keys.idempotency
        self._redis = redis
        self._read: CountsRead | None = None

    # --- what an ask may be -----------------------------------------------------------------

    def check(self, ask: GenerationAsk) -> None:
        """The bound on ``n``, before anything is written."""
        if not 1 <= ask.n <= self.settings.max_choices:
            raise BadRequest(
                f"n must be between 1 and {self.settings.max_choices} (TOKENSPOUT_MAX_CHOICES)",
                code="too_many_choices",
                field="n",
            )

    def of_session(self, tenant_id: str | None) -> Tenant:
        """The tenant a session's turns serve: the one that made it (401 once its key is
        revoked: a key holder's session tokens stop with the key; 503 while this process
        has not read the keys yet)."""
        if not tenant_id:
            return ANONYMOUS  # made by a gateway from before tenants
        tenant = self.directory.by_id(tenant_id)
        if tenant is None and not self.directory.loaded:
            raise keys_not_loaded()
        if tenant is None:
            raise Unauthorized(
                "the API key this session was made with was revoked", code="invalid_api_key"
            )
        return tenant

    def check_model(self, tenant: Tenant, asked: str, model: str) -> None:
        """403 unless ``tenant`` may use ``model`` (asked for as ``asked``)."""
        if tenant.may_use(asked, model):
            return
        if self.observer is not None:
            self.observer.refused(self.directory.label(tenant), "models")
        allowed = ", ".join(sorted(tenant.models))
        raise Forbidden(
            f"key {tenant.name!r} may not use model {asked!r}; it may use: {allowed}",
            code="model_not_allowed",
            field="model",
        )

    # --- what a submit takes ------------------------------------------------------------------

    async def one_shot(
        self, caller: Caller, asked: str, model: str, request: GenerationRequest, *, kept: bool
    ) -> Ticket:
        """A one-shot request's admission: its generation to ``model``'s queue (asked for
        as ``asked``: 403 unless the key may use it; a kept session's is made by commands
        that follow SUBMIT, which would run on a refusal too: admitted first). Where SUBMIT
        can, it admits the request itself (``Ticket.in_submit``); elsewhere the capacity
        and the key's limits are checked now (429)."""
        tenant, gids, count_request = caller.tenant, [request.generation_id], not request.choice
        self.check_model(tenant, asked, model)
        ticket = Ticket(self, caller, tenant, model, gids, count_request=count_request)
        if self.one_node and not kept:
            limits = tenant.limits if tenant.limits.any else None
            ticket.in_submit = await self._in_submit(model, request, limits, count_request)
            return ticket
        await self.guard_capacity(model)
        ticket.taken = await self._admit_key(
            caller, tenant, gids, request.session_id, count_request
        )
        return ticket

    async def turn(
        self,
        caller: Caller,
        tenant: Tenant,
        model: str,
        session_id: str,
        generation_ids: list[str],
        idempotency_key: str | None,
    ) -> Ticket:
        """A session turn's admission (``tenant``: the session's key): room for every
        choice (the capacity checks count each other), then the key's limits. A retried
        POST whose generation exists takes nothing: it must get that generation back (from
        SUBMIT, after the token check), not a 429."""
        try:
            for _ in generation_ids:
                await self.guard_capacity(model)
            taken = await self._admit_key(caller, tenant, generation_ids, session_id, True)
        except Overloaded:  # the capacity, or a limit of the key (RateLimited)
            idem = self._idempotency(session_id, idempotency_key) if idempotency_key else ""
            if not (idem and await self._redis.exists(idem)):
                raise
            taken = False
        return Ticket(self, caller, tenant, model, generation_ids, taken=taken)

    async def _admit_key(
        self,
        caller: Caller,
        tenant: Tenant,
        generation_ids: Sequence[str],
        session_id: str,
        count_request: bool,
    ) -> bool:
        """The key's limits in a round trip of their own (429 at one of them), the key's
        counts left for the response's headers; whether anything was taken that
        ``Ticket.give_back`` gives back (or, the gateway lost before its submit, the
        reaper: gateway/recovery/admissions.py)."""
        if not tenant.limits.any:
            self.settle(caller, tenant, None, count_request=count_request)
            return False
        counts = await self.limits.counts(
            tenant, generation_ids, session_id=session_id, count_request=count_request
        )
        self.settle(caller, tenant, counts, count_request=count_request)
        return True

    def settle(
        self, caller: Caller, tenant: Tenant, counts: Counts | None, *, count_request: bool
    ) -> None:
        """What an admission of ``tenant``'s key found (``counts``; None: it has no
        limits): its quota for ``caller``'s response headers, its metrics, and 429 when it
        refused."""
        label = self.directory.label(tenant)
        try:
            quota = None if counts is None else self.limits.quota(tenant, counts)
        except LimitReached as refusal:
            caller.quota = refusal.quota
            if self.observer is not None:
                self.observer.refused(label, refusal.limit)
            raise RateLimited(
                str(refusal), limit=refusal.limit, retry_after_s=refusal.retry_after_s
            ) from None
        if count_request and self.observer is not None:
            self.observer.admitted(label)
        if quota is not None:
            caller.quota = quota

    # --- capacity ---------------------------------------------------------------------------

    async def guard_capacity(self, model: str) -> None:
        """429 past the global in-flight limit, or past the model's own.

        The counts come from the read on its way when there is one (``CountsRead``), plus
        the generations this process admitted on that read: a burst of requests costs one
        read at a time (a read each costs 5 to 8 us of gateway CPU per token at 500
        streams). A generation whose submit is still on its way is not seen by a check that
        read before it landed, and across gateways the check is not atomic: SUBMIT's own
        check (``Ticket.in_submit``) is, on one Redis."""
        models = await self.queue.models_to_count([model])
        read = self._read
        if read is None or read.task.done() or read.models != models:
            read = self._read = CountsRead(models, self.queue.count(models))
        counts = await asyncio.shield(read.task)
        inflight = sum(queued + running for queued, running in counts.values())
        inflight += sum(read.admitted.values())
        if inflight >= self.settings.max_inflight:
            raise self.overloaded(OverCapacity("all", inflight), model)
        limit = self.settings.max_inflight_per_model
        queued, running = counts.get(model, (0, 0))
        of_model = queued + running + read.admitted.get(model, 0)
        if limit and of_model >= limit:
            raise self.overloaded(OverCapacity("model", of_model), model)
        read.admitted[model] = read.admitted.get(model, 0) + 1

    async def _in_submit(
        self, model: str, request: GenerationRequest, limits: Limits | None, count_request: bool
    ) -> AdmitInSubmit:
        """``guard_capacity``'s check for SUBMIT to make as it queues ``request`` (one
        Redis: every queue counted is on the node the session is), and the ``limits`` of
        its key with it (None: no such check)."""
        models = await self.queue.models_to_count([model])
        waiting = self.queue.waiting(model, request)
        return AdmitInSubmit(
            queues=[self.queue.of(name).key for name in models],
            target=models.index(model),
            limit=self.settings.max_inflight,
            model_limit=self.settings.max_inflight_per_model,
            request=waiting.element,
            tenant=waiting.tenant,
            weight=waiting.weight,
            stream_cap=self.settings.requests_maxlen,
            limits=limits,
            count_request=count_request,
        )

    def overloaded(self, refusal: OverCapacity, model: str) -> Overloaded:
        """The 429 for a check that found the limit reached."""
        if refusal.scope == "all":
            limit = self.settings.max_inflight
            return Overloaded(
                f"{refusal.count} generations are in flight (limit {limit}, "
                "TOKENSPOUT_MAX_INFLIGHT); try again shortly",
                retry_after_s=AGAIN_AFTER_S,
            )
        limit = self.settings.max_inflight_per_model
        return Overloaded(
            f"{refusal.count} generations of {model!r} are in flight (limit {limit} per "
            "model, TOKENSPOUT_MAX_INFLIGHT_PER_MODEL); try again shortly",
            retry_after_s=AGAIN_AFTER_S,
        )

    # --- the keys' admissions, for the reaper -------------------------------------------------

    def with_concurrency_limit(self) -> list[Tenant]:
        """The keys whose running generations are counted (a concurrent limit)."""
        return [tenant for tenant in self.directory.tenants() if tenant.limits.concurrent]

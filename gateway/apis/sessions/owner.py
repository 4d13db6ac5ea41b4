"""A browser's conversations over the session API: the owner cookie and the bodies of the
endpoints that list, change and delete them (gateway/core/conversations.py keeps them).

The owner cookie is HttpOnly (no script reads it) and SameSite=Strict (no other site's
page sends it, so it needs no CSRF token), ``Secure`` when the page came over https. It
authorises everything about its owner's sessions, as a session's token does, so the web
chat puts no token in its EventSource URL (nor in proxy logs).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar.connection import Request
from litestar.datastructures import Cookie

from gateway.core.conversations import Conversation, ConversationSettings, check_title
from gateway.core.errors import BadRequest
from gateway.core.ids import token_urlsafe
from gateway.core.settings import Settings

OWNER_COOKIE = "tokenspout_owner"
OWNER_COOKIE_MAX_AGE_S = 400 * 86_400
"""As long as browsers keep a cookie (Chromium caps it at 400 days)."""

Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]


def owner_of(request: Request[Any, Any, Any]) -> str | None:
    """The owner cookie's secret, when the request carries one."""
    return request.cookies.get(OWNER_COOKIE) or None


def new_owner_cookie(request: Request[Any, Any, Any]) -> tuple[str, Cookie]:
    """A new owner's secret and the cookie that gives it to the browser."""
    secret = token_urlsafe(32)
    https = request.url.scheme == "https" or (
        request.headers.get("x-forwarded-proto", "").lower() == "https"
    )
    cookie = Cookie(
        key=OWNER_COOKIE,
        value=secret,
        max_age=OWNER_COOKIE_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=https,
    )
    return secret, cookie


class ConversationList(msgspec.Struct):
    sessions: list[Conversation]
    """The owner's conversations, the latest updated first."""


class ConversationChange(msgspec.Struct, forbid_unknown_fields=True):
    """``PATCH /v1/sessions/{id}``: the fields given change; ``null`` clears a setting."""

    title: str | msgspec.UnsetType = msgspec.UNSET
    model: str | msgspec.UnsetType = msgspec.UNSET
    """A served model (name or alias): the conversation's next turns go to it."""
    system: str | msgspec.UnsetType | None = msgspec.UNSET
    temperature: Temperature | msgspec.UnsetType | None = msgspec.UNSET
    max_tokens: MaxTokens | msgspec.UnsetType | None = msgspec.UNSET

    def fields(self, settings: Settings) -> dict[str, str | None]:
        """The meta fields to set (None: clear), each checked against its limit."""
        if not any(v is not msgspec.UNSET for v in msgspec.structs.astuple(self)):
            raise BadRequest(
                "nothing to change: give title, model, system, temperature or max_tokens",
                code="empty_change",
            )
        changed: dict[str, str | None] = {}
        if isinstance(self.title, str):
            changed["title"] = check_title(self.title)
        if isinstance(self.model, str):
            changed["model"] = self.model
        if self.system is not msgspec.UNSET:
            changed["system"] = check_system(self.system, settings) or None
        if self.temperature is not msgspec.UNSET:
            changed["temperature"] = None if self.temperature is None else str(self.temperature)
        if self.max_tokens is not msgspec.UNSET:
            if self.max_tokens is not None:
                check_max_tokens(self.max_tokens, settings)
            changed["max_tokens"] = None if self.max_tokens is None else str(self.max_tokens)
        return changed


def check_system(system: str | None, settings: Settings) -> str:
    if system and len(system) > settings.max_message_chars:
        raise BadRequest(
            f"system is longer than {settings.max_message_chars} characters "
            "(TOKENSPOUT_MAX_MESSAGE_CHARS)",
            code="message_too_long",
            field="system",
        )
    return system or ""


def check_max_tokens(max_tokens: int | None, settings: Settings) -> None:
    if max_tokens is not None and max_tokens > settings.max_tokens_limit:
        raise BadRequest(
            f"max_tokens must be between 1 and {settings.max_tokens_limit} "
            "(TOKENSPOUT_MAX_TOKENS_LIMIT)",
            field="max_tokens",
        )


def creation_settings(
    system: str | None, temperature: float | None, max_tokens: int | None, settings: Settings
) -> ConversationSettings:
    """The settings a new session is created with, checked as a change would be."""
    check_max_tokens(max_tokens, settings)
    return ConversationSettings(check_system(system, settings), temperature, max_tokens)

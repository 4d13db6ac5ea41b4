"""What each route really answers, as the OpenAPI document (``/schema``) says it: its error
statuses with the body its API answers them with, and its event streams.

Litestar documents every route's errors as a 400 with its own ``{status_code, detail,
extra}``; the gateway answers 401/403/404/409/410/413/422/429/503 in each API's own shape
(the gateway's ``{"error": {code, message, field}}``, OpenAI's, TGI's, the Open Inference
Protocol's), and streams ``text/event-stream``. ``corrected`` rewrites Litestar's document
from the table here; tests/test_openapi_truth.py sends each route real requests and checks
every answer against the document (schemathesis), so the two cannot drift apart.

Event streams are described as OpenAPI 3.2 does (``itemSchema``: each event's ``event``,
``id`` and ``data``, the data's JSON schema as its ``contentSchema``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.apis.oip.routes import OipError
from gateway.apis.openai.schema import ErrorOut
from gateway.apis.tgi import TgiError
from gateway.core.errors import ErrorEnvelope
from wire import Cancelled, Done, Error, Queued, Resumed, Started, Token

OPENAPI_VERSION = "3.2.0"
"""The first version with a schema for each event of a stream (``itemSchema``)."""
REF = "#/components/schemas/{name}"

WHY = {
    400: "Invalid request: the message says what, `param` names the field",
    401: "An API key is needed (TOKENSPOUT_API_KEYS, run-time keys), or the one given is wrong",
    403: "Not this caller's: a session's token or owner cookie, a model the key may not use",
    404: "No such session, generation, key, response or model",
    409: "In the way of another: a reply still running, nothing to regenerate or continue",
    410: "The events after the resume point were trimmed (TOKENSPOUT_EVENTS_MAXLEN)",
    413: "The body is over TOKENSPOUT_MAX_BODY_BYTES",
    422: "Invalid request: the message says what, `field` names the field",
    429: "Over a limit (the gateway's capacity, the key's): `Retry-After` says when to retry",
    500: "An error of the gateway's own, logged with its traceback",
    503: "Redis or the engine is not there now: `Retry-After`, when it knows",
}


@dataclass(frozen=True, slots=True)
class Family:
    """An API family: the body its errors have (a component of the document)."""

    name: str
    error: type[msgspec.Struct]
    invalid: int = 422
    """The status of a request it cannot take (OpenAI's is 400)."""


GATEWAY = Family("GatewayError", ErrorEnvelope)
OPENAI = Family("OpenAIError", ErrorOut, invalid=400)
TGI = Family("TGIError", TgiError)
OIP = Family("OIPError", OipError)


@dataclass(frozen=True, slots=True)
class Stream:
    """An event stream's events: their names (None: unnamed, ``message``) and their data."""

    events: dict[str | None, dict[str, Any]]
    json_too: bool = True
    """The route answers JSON when not asked to stream (OpenAI, TGI's ``/generate``)."""


@dataclass(frozen=True, slots=True)
class Answers:
    family: Family
    errors: tuple[int, ...]
    stream: Stream | None = None
    bodies: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Statuses whose body is no error (``/ready``'s 503 is its readiness)."""


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF.format(name=name)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    """An event's ``data``: JSON text, of ``schema``."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


OBJECT: dict[str, Any] = {"type": "object"}
SESSION_EVENT_TYPES = {
    "queued": Queued,
    "started": Started,
    "token": Token,
    "resumed": Resumed,
    "done": Done,
    "cancelled": Cancelled,
    "error": Error,
}
EVENTS_LOST: dict[str, Any] = {
    "type": "object",
    "required": ["type", "last_event_id", "message"],
    "properties": {"type": {"const": "events_lost"}, "last_event_id": {"type": "string"}},
}
SESSION_STREAM = Stream(
    {
        **{
            name: _json(_ref(f"Event{kind.__name__}")) for name, kind in SESSION_EVENT_TYPES.items()
        },
        "error": _json({"anyOf": [_ref("EventError"), _ref("GatewayError")]}),
        "events_lost": _json(EVENTS_LOST),
    },
    json_too=False,
)
OPENAI_STREAM = Stream({None: {"type": "string", "if": {"const": "[DONE]"}, "else": _json(OBJECT)}})
"""Chunks (or an error object) as JSON, then ``[DONE]``."""
RESPONSES_STREAM = Stream(
    {
        "response.*": _json({**OBJECT, "required": ["type", "sequence_number"]}),
        "error": _json({**OBJECT, "required": ["type", "code", "message"]}),
    }
)
TGI_STREAM = Stream({None: _json(OBJECT)})
OIP_STREAM = Stream({None: _json(OBJECT)}, json_too=False)

SESSION = (403, 404, 500, 503)
TURN = (401, 403, 404, 409, 413, 422, 429, 500, 503)
ADMIN = (401, 403, 500, 503)
GENERATE = (401, 403, 404, 413, 429, 500, 503)
ROUTES: dict[tuple[str, str], Answers] = {
    ("GET", "/health"): Answers(GATEWAY, ()),
    ("GET", "/metrics"): Answers(GATEWAY, ()),
    ("GET", "/ready"): Answers(GATEWAY, (500,), bodies={503: _ref("Readiness")}),
    ("POST", "/v1/sessions"): Answers(GATEWAY, (401, 404, 413, 422, 500, 503)),
    ("GET", "/v1/sessions"): Answers(GATEWAY, (500, 503)),
    ("GET", "/v1/sessions/{session_id}"): Answers(GATEWAY, SESSION),
    ("PATCH", "/v1/sessions/{session_id}"): Answers(GATEWAY, (403, 404, 413, 422, 500, 503)),
    ("DELETE", "/v1/sessions/{session_id}"): Answers(GATEWAY, SESSION),
    ("POST", "/v1/sessions/{session_id}/messages"): Answers(GATEWAY, TURN),
    ("POST", "/v1/sessions/{session_id}/regenerate"): Answers(GATEWAY, TURN),
    ("POST", "/v1/sessions/{session_id}/continue"): Answers(GATEWAY, TURN),
    ("GET", "/v1/sessions/{session_id}/events"): Answers(
        GATEWAY, (*SESSION, 410, 422), SESSION_STREAM
    ),
    ("POST", "/v1/sessions/{session_id}/generations/{generation_id}/cancel"): Answers(
        GATEWAY, SESSION
    ),
    ("POST", "/v1/admin/keys"): Answers(GATEWAY, (*ADMIN, 413, 422)),
    ("GET", "/v1/admin/keys"): Answers(GATEWAY, ADMIN),
    ("GET", "/v1/admin/keys/{key_id}"): Answers(GATEWAY, (*ADMIN, 404)),
    ("PATCH", "/v1/admin/keys/{key_id}"): Answers(GATEWAY, (*ADMIN, 404, 409, 413, 422)),
    ("DELETE", "/v1/admin/keys/{key_id}"): Answers(GATEWAY, (*ADMIN, 404, 409)),
    ("GET", "/v1/admin/usage"): Answers(GATEWAY, (*ADMIN, 404, 422)),
    ("POST", "/v1/chat/completions"): Answers(OPENAI, (400, *GENERATE), OPENAI_STREAM),
    ("POST", "/v1/completions"): Answers(OPENAI, (400, *GENERATE), OPENAI_STREAM),
    ("GET", "/v1/models"): Answers(OPENAI, (401, 500, 503)),
    ("POST", "/v1/responses"): Answers(OPENAI, (400, *GENERATE), RESPONSES_STREAM),
    ("GET", "/v1/responses/{response_id}"): Answers(
        OPENAI, (400, 401, 404, 410, 500, 503), RESPONSES_STREAM
    ),
    ("DELETE", "/v1/responses/{response_id}"): Answers(OPENAI, (401, 404, 500, 503)),
    ("POST", "/v1/responses/{response_id}/cancel"): Answers(OPENAI, (400, 401, 404, 500, 503)),
    ("GET", "/v1/responses/{response_id}/input_items"): Answers(OPENAI, (401, 404, 500, 503)),
    ("POST", "/tokenize"): Answers(OPENAI, (400, *GENERATE)),
    ("POST", "/detokenize"): Answers(OPENAI, (400, *GENERATE)),
    ("POST", "/generate"): Answers(TGI, (422, *GENERATE), TGI_STREAM),
    ("POST", "/"): Answers(TGI, (422, *GENERATE), TGI_STREAM),
    ("POST", "/generate_stream"): Answers(TGI, (422, *GENERATE), TGI_STREAM),
    ("GET", "/info"): Answers(TGI, (401, 500, 503)),
    ("POST", "/v2/models/{model}/generate"): Answers(OIP, (422, *GENERATE)),
    ("POST", "/v2/models/{model}/generate_stream"): Answers(OIP, (422, *GENERATE), OIP_STREAM),
    ("GET", "/v2/models/{model}/ready"): Answers(OIP, (401, 404, 500, 503)),
}
"""Every route's error statuses (its success is Litestar's: the handler's own status)."""

METRICS = {
    "get": {
        "tags": ["operations"],
        "summary": "Prometheus metrics",
        "operationId": "Metrics",
        "responses": {
            "200": {
                "description": "The Prometheus text format (every process's with --workers N)",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    }
}


def _item_schema(stream: Stream) -> dict[str, Any]:
    """One event of ``stream``: its name (``message`` when it has none; ``prefix.*``: any
    name that starts so), its id, its data (as its name says)."""
    patterns = [
        f"^{re.escape(name[:-1])}" if name.endswith("*") else f"^{re.escape(name)}$"
        for name in (event or "message" for event in stream.events)
    ]
    cases = [
        {
            "if": {"required": ["event"], "properties": {"event": {"pattern": pattern}}},
            "then": {"properties": {"data": data}},
        }
        for pattern, data in zip(patterns, stream.events.values(), strict=True)
    ]
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string", "pattern": "|".join(patterns)},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
            "data": {"type": "string"},
        },
        "allOf": cases,
    }


def _components() -> dict[str, Any]:
    """The error bodies and the session events, as components."""
    families = (GATEWAY, OPENAI, TGI, OIP)
    _, shared = msgspec.json.schema_components(
        [*SESSION_EVENT_TYPES.values()], ref_template=REF.replace("{name}", "Event{name}")
    )
    found = {f"Event{name}": schema for name, schema in shared.items()}
    for family in families:
        _, parts = msgspec.json.schema_components(
            [family.error], ref_template=REF.replace("{name}", f"{family.name}_{{name}}")
        )
        body = parts.pop(family.error.__name__)
        found[family.name] = body
        found.update({f"{family.name}_{name}": schema for name, schema in parts.items()})
    return found


def _responses(answers: Answers, success: dict[str, Any]) -> dict[str, Any]:
    kept = {status: response for status, response in success.items() if status.startswith("2")}
    if answers.stream is not None:
        for response in kept.values():
            media = {"text/event-stream": {"itemSchema": _item_schema(answers.stream)}}
            if answers.stream.json_too:
                media = {**response.get("content", {}), **media}
            response["content"] = media
    for status in answers.errors:
        kept[str(status)] = {
            "description": WHY[status],
            "content": {"application/json": {"schema": _ref(answers.family.name)}},
        }
    for status, schema in answers.bodies.items():
        kept[str(status)] = {
            "description": WHY[status],
            "content": {"application/json": {"schema": schema}},
        }
    return dict(sorted(kept.items()))


def unanswered(document: dict[str, Any]) -> list[str]:
    """The operations of ``document`` the table has no answers for."""
    return [
        f"{method.upper()} {path}"
        for path, item in document.get("paths", {}).items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
        and (method.upper(), path) not in ROUTES
    ]


def corrected(document: dict[str, Any]) -> dict[str, Any]:
    """Litestar's document with each route's real answers (a copy)."""
    fixed = copy.deepcopy(document)
    fixed["openapi"] = OPENAPI_VERSION
    for path, item in fixed.get("paths", {}).items():
        for method, operation in item.items():
            answers = ROUTES.get((method.upper(), path))
            if answers is not None:
                operation["responses"] = _responses(answers, operation.get("responses", {}))
    fixed["paths"]["/metrics"] = METRICS
    fixed.setdefault("components", {}).setdefault("schemas", {}).update(_components())
    return fixed

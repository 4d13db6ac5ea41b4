"""Structured outputs, checked before anything is queued.

A request may constrain its reply in four spellings (OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields); they all become one
``wire.StructuredOutput`` here. What needs no model is checked here, so a bad schema or
regex is a 400 that names the problem instead of an engine error after the queue: a JSON
schema must be a valid schema of its draft, a regex must compile, a choice must be a
non-empty list of strings. What needs the model's grammar backend (an EBNF grammar) is
checked by the engine, which ends the reply with an ``error`` event.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import jsonschema.exceptions

from gateway.errors import BadRequest
from wire import StructuredOutput

MAX_CONSTRAINT_BYTES = 64 * 1024
"""A schema, regex or grammar larger than this is refused (grammar compilation in the
engine grows with it)."""


def _refuse(field: str, message: str) -> BadRequest:
    return BadRequest(message, code="invalid_structured_output", field=field)


def json_schema(field: str, schema: dict[str, Any] | str) -> StructuredOutput:
    """A JSON-schema constraint, the schema checked against its draft's meta-schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise _refuse(field, f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise _refuse(field, "a JSON schema must be an object")
    text = json.dumps(schema)
    _check_size(field, text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path) or "(root)"
        raise _refuse(field, f"invalid JSON schema at {where}: {exc.message}") from None
    return StructuredOutput(json=text)


def regex(field: str, pattern: str) -> StructuredOutput:
    _check_size(field, pattern)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise _refuse(field, f"invalid regex: {exc}") from None
    return StructuredOutput(regex=pattern)


def choice(field: str, choices: list[str]) -> StructuredOutput:
    if not choices or any(not option for option in choices):
        raise _refuse(field, "choice must be a list of non-empty strings")
    _check_size(field, json.dumps(choices))
    return StructuredOutput(choice=list(choices))


def grammar(field: str, text: str) -> StructuredOutput:
    if not text.strip():
        raise _refuse(field, "the grammar is empty")
    _check_size(field, text)
    return StructuredOutput(grammar=text)


def only_one(found: list[tuple[str, StructuredOutput]]) -> StructuredOutput | None:
    """The one constraint a request sets; two at once are refused, as vLLM does."""
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise _refuse(found[1][0], f"only one structured-output constraint may be set ({names})")
    return found[0][1] if found else None


def _check_size(field: str, text: str) -> None:
    if len(text.encode()) > MAX_CONSTRAINT_BYTES:
        raise _refuse(field, f"the constraint is larger than {MAX_CONSTRAINT_BYTES} bytes")

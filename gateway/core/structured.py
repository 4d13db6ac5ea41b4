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
from typing import Any, Literal

import jsonschema
import jsonschema.exceptions
import msgspec

from gateway.core.errors import BadRequest
from wire import StructuredOutput

MAX_CONSTRAINT_BYTES = 64 * 1024
"""A schema, regex or grammar larger than this is refused (grammar compilation in the
engine grows with it)."""


# --- how requests spell a constraint ---------------------------------------------------


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsIn(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` field: one constraint."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class Guided(msgspec.Struct, kw_only=True):
    """vLLM's older ``guided_*`` fields, as one value."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def constraint(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsIn | None = None,
    guided: Guided | None = None,
) -> StructuredOutput | None:
    """The one constraint a request sets, in whichever of its spellings, checked."""
    found: list[tuple[str, StructuredOutput]] = []
    form = response_format
    if form is not None and form.type == "json_object":
        found.append(("response_format", StructuredOutput(json_object=True)))
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None or form.json_schema.schema is None:
            raise _invalid_constraint("response_format.json_schema", "json_schema needs a schema")
        found.append(("response_format", json_schema("response_format", form.json_schema.schema)))
    wanted, field = structured_outputs, "structured_outputs"
    if wanted is not None:
        before = len(found)
        if wanted.json is not None:
            found.append((f"{field}.json", json_schema(f"{field}.json", wanted.json)))
        if wanted.regex is not None:
            found.append((f"{field}.regex", regex(f"{field}.regex", wanted.regex)))
        if wanted.choice is not None:
            found.append((f"{field}.choice", choice(f"{field}.choice", wanted.choice)))
        if wanted.grammar is not None:
            found.append((f"{field}.grammar", grammar(f"{field}.grammar", wanted.grammar)))
        if wanted.json_object:
            found.append((f"{field}.json_object", StructuredOutput(json_object=True)))
        if len(found) == before:
            raise _invalid_constraint(field, "set one of json, regex, choice, grammar, json_object")
    if guided is not None:
        if guided.guided_json is not None:
            found.append(("guided_json", json_schema("guided_json", guided.guided_json)))
        if guided.guided_regex is not None:
            found.append(("guided_regex", regex("guided_regex", guided.guided_regex)))
        if guided.guided_choice is not None:
            found.append(("guided_choice", choice("guided_choice", guided.guided_choice)))
        if guided.guided_grammar is not None:
            found.append(("guided_grammar", grammar("guided_grammar", guided.guided_grammar)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise _invalid_constraint(
            found[1][0], f"only one structured-output constraint may be set ({names})"
        )
    return found[0][1] if found else None


# --- checks ------------------------------------------------------------------------------


def _invalid_constraint(field: str, message: str) -> BadRequest:
    return BadRequest(message, code="invalid_structured_output", field=field)


def json_schema(field: str, schema: dict[str, Any] | str) -> StructuredOutput:
    """A JSON-schema constraint, the schema checked against its draft's meta-schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise _invalid_constraint(field, f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise _invalid_constraint(field, "a JSON schema must be an object")
    text = json.dumps(schema)
    _check_size(field, text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path) or "(root)"
        raise _invalid_constraint(field, f"invalid JSON schema at {where}: {exc.message}") from None
    return StructuredOutput(json=text)


def regex(field: str, pattern: str) -> StructuredOutput:
    _check_size(field, pattern)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise _invalid_constraint(field, f"invalid regex: {exc}") from None
    return StructuredOutput(regex=pattern)


def choice(field: str, choices: list[str]) -> StructuredOutput:
    if not choices or any(not option for option in choices):
        raise _invalid_constraint(field, "choice must be a list of non-empty strings")
    _check_size(field, json.dumps(choices))
    return StructuredOutput(choice=list(choices))


def grammar(field: str, text: str) -> StructuredOutput:
    if not text.strip():
        raise _invalid_constraint(field, "the grammar is empty")
    _check_size(field, text)
    return StructuredOutput(grammar=text)


def _check_size(field: str, text: str) -> None:
    if len(text.encode()) > MAX_CONSTRAINT_BYTES:
        raise _invalid_constraint(
            field, f"the constraint is larger than {MAX_CONSTRAINT_BYTES} bytes"
        )

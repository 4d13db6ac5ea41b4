"""Function calling, checked before anything is queued, and the constraint that makes a
forced call valid.

The gateway needs no model for this: it checks the functions (names, parameter schemas),
the choice (a named function must be one of them) and the messages that carry calls and
their results; for ``tool_choice`` ``required`` or a named function it sets the structured
output that the engine applies, so the arguments always validate against the function's
parameters (vLLM's own server gives a named call's arguments unconstrained). Rendering the
functions into the prompt and finding the calls in ``auto`` replies need the model's chat
template and tool parser: the worker does those (engine/tools.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.core import structured
from gateway.core.errors import BadRequest
from wire import StructuredOutput, ToolCall, ToolCallDelta, ToolChoiceMode, Tools, ToolSpec

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a function's name."""
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _invalid_tools(field: str, message: str) -> BadRequest:
    return BadRequest(message, code="invalid_tools", field=field)


def tools_of(
    specs: list[ToolSpec] | None,
    choice: ToolChoiceMode | None,
    name: str | None,
    parallel: bool | None,
) -> Tools | None:
    """The request's functions and choice, checked; None when it offers none (or
    ``tool_choice`` is ``none`` and it offers none)."""
    if not specs:
        if choice in ("required", "named"):
            raise _invalid_tools("tool_choice", f"tool_choice {choice} needs tools")
        return None
    seen: set[str] = set()
    for index, spec in enumerate(specs):
        field = f"tools[{index}].function"
        if not FUNCTION_NAME.fullmatch(spec.name):
            raise _invalid_tools(
                f"{field}.name", "a function's name is 1-64 of a-z, A-Z, 0-9, _ and -"
            )
        if spec.name in seen:
            raise _invalid_tools(f"{field}.name", f"two functions are named {spec.name!r}")
        seen.add(spec.name)
        structured.json_schema(f"{field}.parameters", spec.parameters or ANY_OBJECT)
    if choice == "named" and name not in seen:
        raise _invalid_tools("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    return Tools(specs, choice or "auto", name, parallel is not False)


def constraint(tools: Tools | None) -> StructuredOutput | None:
    """What the engine must write for a forced call: the named function's arguments, or
    (``required``) a JSON array of ``{"name", "parameters"}`` calls, one or more (one
    when calls may not be parallel)."""
    if tools is None or tools.choice in ("none", "auto"):
        return None
    if tools.choice == "named":
        spec = next(spec for spec in tools.specs if spec.name == tools.name)
        return StructuredOutput(json=json.dumps(spec.parameters or ANY_OBJECT))
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [spec.name]},
                    "parameters": spec.parameters or ANY_OBJECT,
                },
                "required": ["name", "parameters"],
            }
            for spec in tools.specs
        ]
    }
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls}
    if not tools.parallel:
        array["maxItems"] = 1
    return StructuredOutput(json=json.dumps(array))


def add_to_call(call: ToolCall | None, delta: ToolCallDelta) -> ToolCall:
    """A call with its next piece added (the first piece names it)."""
    if call is None:
        return ToolCall(delta.id or "", delta.name or "", delta.arguments)
    return ToolCall(call.id, call.name, call.arguments + delta.arguments)

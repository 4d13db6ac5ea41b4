"""docs/api.md's table of error codes is the list of codes the product sends, both ways.

The codes sent are read from the code itself (its syntax tree, and the Lua scripts' JSON):
a ``code=`` given to an error, a class's ``default_code`` where the class is raised without
one, a ``code`` chosen by assignment, the code of a generation's ``Error`` event, of a
``BackendError`` and of a WebSocket ``ErrorFrame``. A code added to the product without a
row fails here, and so does a row for a code nothing sends (``context_exceeded`` was
documented where ``prompt_too_long`` was sent).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("gateway", "engine", "wire")
CODE_ARGUMENT = {"BackendError": 0, "ErrorFrame": 0, "Error": 1}
"""Calls whose positional argument at that index is a code: the engine's errors, the
WebSocket's error frames, a generation's ``Error(generation_id, code, message)`` event."""
LUA_CODE = re.compile(r'\\?"code\\?"\s*:\s*\\?"([a-z_]+)')
ROW = re.compile(r"^\| (`[a-z_]+`(?:, `[a-z_]+`)*) \|", re.MULTILINE)
ERRORS_MODULE = "gateway.core.errors"


def strings(node: ast.AST | None) -> Iterator[str]:
    """The string constants an expression can be (both sides of a conditional)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.IfExp):
        yield from strings(node.body)
        yield from strings(node.orelse)


def called(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def error_classes(tree: ast.AST, defaults: dict[str, str]) -> dict[str, str]:
    """The error classes a module knows by name (imported from gateway/core/errors.py, or
    its own), with their default codes: another module's class of the same name is none."""
    known = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == ERRORS_MODULE:
            known |= {
                alias.name: defaults[alias.name] for alias in node.names if alias.name in defaults
            }
        elif isinstance(node, ast.ClassDef) and node.name in defaults:
            known[node.name] = defaults[node.name]
    return known


def codes_in(tree: ast.AST, all_defaults: dict[str, str]) -> Iterator[str]:
    defaults = error_classes(tree, all_defaults)
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "code":
            yield from strings(node.value)
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == "code" for t in node.targets):
                yield from strings(node.value)
        elif isinstance(node, ast.Call):
            name = called(node)
            index = CODE_ARGUMENT.get(name or "")
            if index is not None and len(node.args) > index:
                yield from strings(node.args[index])
            elif name in defaults and not any(k.arg == "code" for k in node.keywords):
                yield defaults[name]  # raised without a code: its class's own


def class_defaults(trees: list[ast.AST]) -> dict[str, str]:
    """Error class -> its ``default_code``."""
    defaults = {}
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for statement in node.body:
                if isinstance(statement, ast.Assign):
                    targets, value = statement.targets, statement.value
                elif isinstance(statement, ast.AnnAssign):  # the base: annotated
                    targets, value = [statement.target], statement.value
                else:
                    continue
                if any(isinstance(t, ast.Name) and t.id == "default_code" for t in targets):
                    defaults[node.name] = next(strings(value))
    return defaults


@functools.cache
def sent() -> frozenset[str]:
    files = [path for source in SOURCES for path in (ROOT / source).rglob("*.py")]
    trees = [ast.parse(path.read_text(), str(path)) for path in files]
    defaults = class_defaults(trees)
    codes = {code for tree in trees for code in codes_in(tree, defaults)}
    for script in (ROOT / "wire" / "lua").glob("*.lua"):
        codes |= set(LUA_CODE.findall(script.read_text()))
    return frozenset(codes)


def documented() -> set[str]:
    text = (ROOT / "docs" / "api.md").read_text()
    table = text.split("\n## Error codes\n", 1)[1].split("\n## ", 1)[0]
    return {code.strip("` ") for row in ROW.findall(table) for code in row.split(",")}


def test_the_scan_finds_codes_of_every_kind_of_source() -> None:
    """So that an empty scan cannot pass: a ``code=``, a class default raised bare, an
    assignment, an engine error, a generation's event, and a Lua script's."""
    assert {
        "bad_event_id",
        "events_expired",
        "method_not_allowed",
        "prompt_too_long",
        "queue_timeout",
        "events_lost",
    } <= sent()


def test_every_code_sent_is_documented() -> None:
    assert sent() - documented() == set()


def test_every_documented_code_is_sent() -> None:
    assert documented() - sent() == set()

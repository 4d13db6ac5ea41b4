"""docs/configuration.md's generated tables: ``python -m stack.configdoc`` rewrites them.

The document is prose plus blocks between ``<!-- generated: NAME -->`` and
``<!-- end: NAME -->``; each block is rendered from the code (gateway/core/settings.py, the
engine's argument parser and variables, wire/tracing.py's variables), and
tests/test_configuration_doc.py fails when the file and the code disagree.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from engine.__main__ import markdown_tables as engine_tables
from gateway.core.settings import markdown_table as gateway_table
from wire.tracing import ENVIRONMENT as TRACING

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def tracing_table() -> str:
    """OpenTelemetry's variables, which the gateway and the worker read alike."""
    rows = ["| variable | meaning |", "| --- | --- |"]
    rows += [f"| `{name}` | {meaning} |" for name, meaning in TRACING.items()]
    return "\n".join(rows) + "\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "gateway": gateway_table,
    "engine": engine_tables,
    "tracing": tracing_table,
}
_BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end: \2 -->)", re.DOTALL)


def render(text: str) -> str:
    """``text`` with every generated block replaced by what the code says now."""
    seen: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        name = match.group(2)
        seen.add(name)
        return f"{match.group(1)}{BLOCKS[name]()}{match.group(4)}"

    rendered = _BLOCK.sub(fill, text)
    missing = set(BLOCKS) - seen
    if missing:
        raise ValueError(f"{DOC.name} lacks the generated blocks {sorted(missing)}")
    return rendered


def main() -> None:
    DOC.write_text(render(DOC.read_text()))
    sys.stdout.write(f"wrote {DOC}\n")


if __name__ == "__main__":
    main()

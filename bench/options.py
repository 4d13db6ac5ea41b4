"""The command line of a bench whose settings are a dataclass of defaults: a flag for each
field (``--warmup-s`` for ``warmup_s``), typed as its default is; ``--no-X`` for a bool; one
or more values for a list; a path for ``out``."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def parse_options(
    kind: type[T],
    argv: list[str],
    prog: str,
    description: str | None,
    choices: Mapping[str, Sequence[str]] | None = None,
) -> T:
    """``kind``'s settings from ``argv``: its defaults, with what the flags give; a list's
    values are among ``choices`` of its name, where given."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    hints = typing.get_type_hints(kind)
    defaults: Any = kind()
    for field in dataclasses.fields(defaults):
        value = getattr(defaults, field.name)
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif isinstance(value, list):
            (item,) = typing.get_args(hints[field.name])
            among = list((choices or {}).get(field.name, ())) or None
            parser.add_argument(flag, type=item, nargs="+", choices=among, default=value)
        else:
            parser.add_argument(
                flag, type=Path if field.name == "out" else type(value), default=value
            )
    return kind(**vars(parser.parse_args(argv)))

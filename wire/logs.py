"""Structured logs: one line per event, ``key=value`` pairs, no message text by default.

A line reads ``ts=... level=info service=gateway logger=tokenspout.http msg='request'
request_id=... session_id=... status=200``: the fixed fields, then whatever the call passed
in ``extra=`` (ids, states, counts). Code logs ids and numbers, never what a user wrote or
what a model answered; tests/test_logs.py checks that at the default level.
"""

from __future__ import annotations

import logging
import re
import sys
import time

_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "color_message"}  # uvicorn's coloured copy of msg
)


_PLAIN = re.compile(r"[\w.:/{}+-]+")
"""A value written bare; anything else (a space, a quote, nothing) is quoted."""


def _value(value: object) -> str:
    text = str(value)
    return text if _PLAIN.fullmatch(text) else repr(text)


class KeyValueFormatter(logging.Formatter):
    """It writes lines for every request at INFO, so it is written for speed: the
    timestamp's seconds made once a second, each value checked by one regex."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second, self._stamp = second, stamp
        parts = [
            f"ts={self._stamp}.{int(record.msecs):03d}Z level={record.levelname.lower()} "
            f"service={self.service} logger={record.name} msg={record.getMessage()!r}"
        ]
        parts += [
            f"{key}={_value(value)}"
            for key, value in record.__dict__.items()
            if key not in _STANDARD and not key.startswith("_")
        ]
        line = " ".join(parts)
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return line


def configure_logging(level: str, service: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

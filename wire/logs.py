"""Structured logs: one line per event, ``key=value`` pairs, no message text by default.

A line reads ``ts=... level=info service=gateway logger=tokenspout.http msg='request'
request_id=... session_id=... status=200``: the fixed fields, then whatever the call passed
in ``extra=`` (ids, states, counts). Code logs ids and numbers, never what a user wrote or
what a model answered; tests/test_logs.py checks that at the default level.
"""

from __future__ import annotations

import logging
import sys
import time

_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "color_message"}  # uvicorn's coloured copy of msg
)


def _value(value: object) -> str:
    text = str(value)
    if text and all(ch.isalnum() or ch in "._:/-{}+" for ch in text):
        return text
    return repr(text)


class KeyValueFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (
            f"ts={stamp}.{int(record.msecs):03d}Z level={record.levelname.lower()} "
            f"service={self.service} logger={record.name} msg={record.getMessage()!r}"
        )
        extras = [
            f"{key}={_value(value)}"
            for key, value in record.__dict__.items()
            if key not in _STANDARD and not key.startswith("_")
        ]
        if extras:
            line += " " + " ".join(extras)
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return line


def configure_logging(level: str, service: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

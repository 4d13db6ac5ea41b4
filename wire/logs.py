"""Structured logs: one line per event, no message text by default.

A line reads ``ts=... level=info service=gateway logger=tokenspout.http msg='request'
request_id=... session_id=... status=200``: the fixed fields, then whatever the call passed
in ``extra=`` (ids, states, counts), then the ``trace_id`` of the request it is about when
that request has a trace (wire/tracing.py). ``TOKENSPOUT_LOG_FORMAT=json`` writes the same
fields as one JSON object per line, for a log store to query. Code logs ids and numbers,
never what a user wrote or what a model answered; tests/test_logs.py checks that at the
default level.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

import msgspec

from wire.tracing import LOG_TRACE_ID

_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", (), None).__dict__.keys()
    | {"message", "asctime", "color_message"}  # uvicorn's coloured copy of msg
)


_PLAIN = re.compile(r"[\w.:/{}+-]+")
"""A value written bare; anything else (a space, a quote, nothing) is quoted."""


def _value(value: object) -> str:
    text = str(value)
    return text if _PLAIN.fullmatch(text) else repr(text)


def _extra(record: logging.LogRecord) -> dict[str, Any]:
    """What the call passed in ``extra=``, and the trace id of the request it is about."""
    fields = {
        key: value
        for key, value in record.__dict__.items()
        if key not in _STANDARD and not key.startswith("_")
    }
    if "trace_id" not in fields and (trace_id := LOG_TRACE_ID.get()):
        fields["trace_id"] = trace_id
    return fields


class KeyValueFormatter(logging.Formatter):
    """It writes lines for every request at INFO, so it is written for speed: the
    timestamp's seconds made once a second, each value checked by one regex."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        self._second = -1
        self._stamp = ""

    def stamp(self, record: logging.LogRecord) -> str:
        """``2025-01-31T12:00:00.123Z``, its seconds made once a second."""
        second = int(record.created)
        if second != self._second:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second, self._stamp = second, stamp
        return f"{self._stamp}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            f"ts={self.stamp(record)} level={record.levelname.lower()} "
            f"service={self.service} logger={record.name} msg={record.getMessage()!r}"
        ]
        parts += [f"{key}={_value(value)}" for key, value in _extra(record).items()]
        line = " ".join(parts)
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return line


class JsonFormatter(KeyValueFormatter):
    """The same fields as one JSON object per line (values that are not JSON as text)."""

    _encoder = msgspec.json.Encoder(enc_hook=str)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": self.stamp(record),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(_extra(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return self._encoder.encode(line).decode()


def configure_logging(level: str, service: str, log_format: str = "text") -> None:
    """The process's logs on stderr: ``text`` (key=value) or ``json`` lines."""
    if log_format not in ("text", "json"):
        raise ValueError(f"TOKENSPOUT_LOG_FORMAT={log_format!r}: 'text' or 'json'")
    formatter = JsonFormatter(service) if log_format == "json" else KeyValueFormatter(service)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())

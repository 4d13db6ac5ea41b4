"""The gateway's configuration: one object, read from the environment once at start-up.

Every field is ``TOKENSPOUT_<NAME>`` in the environment (``REDIS_URL`` has no prefix).
``python -m gateway.core.settings`` prints the table that docs/configuration.md holds; a test keeps
the two in step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from wire import DEFAULT_PREFIX

ENV_PREFIX = "TOKENSPOUT_"
UNPREFIXED = frozenset({"redis_url"})
_D = msgspec.Meta


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    redis_url: Annotated[str, _D(description="Redis to keep sessions in.")] = (
        "redis://127.0.0.1:6379/0"
    )
    key_prefix: Annotated[str, _D(description="Prefix of every Redis key.")] = DEFAULT_PREFIX
    session_ttl_s: Annotated[
        int,
        _D(ge=60, description="Lifetime of a session's keys, renewed by every message."),
    ] = 86_400
    responses_ttl_s: Annotated[
        int,
        _D(
            ge=60,
            description="Lifetime of a stored `/v1/responses` response (its session's keys), "
            "from its creation.",
        ),
    ] = 86_400
    stateless_ttl_s: Annotated[
        int,
        _D(
            ge=60,
            description="Lifetime of a one-shot request's keys (OpenAI, TGI, OIP, gRPC; a "
            "stored response has its own): its events and its generation's record, from "
            "its submit.",
        ),
    ] = 600
    events_maxlen: Annotated[
        int, _D(ge=100, description="Events kept per session stream (older ones trimmed).")
    ] = 20_000
    max_history_messages: Annotated[
        int, _D(ge=2, description="Messages one session may hold; past it, 422.")
    ] = 200
    max_conversations: Annotated[
        int,
        _D(
            ge=1,
            description="Conversations one browser (its owner cookie) lists; past it, the one "
            "updated least recently leaves the list (its session lives until its TTL).",
        ),
    ] = 200
    max_message_chars: Annotated[
        int, _D(ge=1, description="Longest accepted message content, in characters.")
    ] = 32_000
    max_body_bytes: Annotated[
        int,
        _D(
            ge=1024,
            description="Largest accepted request body or WebSocket frame; past it, 413 (a "
            "`frame_too_large` error frame); a frame over 4 times it closes the socket (1009).",
        ),
    ] = 262_144
    max_tokens_limit: Annotated[
        int, _D(ge=1, description="Highest max_tokens a request may ask for.")
    ] = 4_096
    max_choices: Annotated[
        int,
        _D(
            ge=1,
            description="Highest `n` (choices per request) of the OpenAI endpoints; each "
            "choice is a generation of its own and counts toward the in-flight limits.",
        ),
    ] = 16
    default_max_tokens: Annotated[
        int, _D(ge=1, description="max_tokens when a request names none.")
    ] = 256
    max_inflight: Annotated[
        int,
        _D(ge=1, description="Queued plus running generations, all workers; past it, 429."),
    ] = 256
    scheduler: Annotated[
        Literal["fair", "fifo"],
        _D(
            description="How a model's waiting requests are served: fair (each tenant, an "
            "API key, gets a share of the engine by the tokens it is served, its weight "
            "times the others'; docs/tenants.md) or fifo (first come, first served)."
        ),
    ] = "fair"
    anonymous_usage: Annotated[
        bool,
        _D(
            description="Count the usage of requests with no key in Redis (the admin API's "
            "usage of `anonymous`), as a key's is counted; off, they cost no bookkeeping "
            "(the engine workers' /metrics count their tokens either way).",
        ),
    ] = False
    max_inflight_per_model: Annotated[
        int,
        _D(
            ge=0,
            description="Queued plus running generations of one model; past it, 429. "
            "0: only the global limit.",
        ),
    ] = 0
    default_model: Annotated[
        str,
        _D(
            description="Model (or alias) of requests that name none (session API, TGI, "
            "web chat); empty: the only live model, else they must name one (400).",
        ),
    ] = ""
    abandon_grace_s: Annotated[
        float, _D(gt=0, description="A generation nobody reads for this long is aborted.")
    ] = 30
    sse_heartbeat_s: Annotated[
        float, _D(gt=0, description="Seconds between SSE heartbeat comments when idle.")
    ] = 15.0
    sse_retry_ms: Annotated[
        int, _D(ge=0, description="Reconnect delay suggested to EventSource clients.")
    ] = 1_000
    stream_buffer_events: Annotated[
        int,
        _D(ge=8, description="Events buffered per slow reader before it re-reads Redis."),
    ] = 512
    worker_timeout_s: Annotated[
        float,
        _D(
            gt=0,
            description="A worker silent this long is lost (sooner when its lease connection "
            "to Redis closes); its replies are taken over.",
        ),
    ] = 5.0
    queue_timeout_s: Annotated[
        float,
        _D(
            gt=0,
            description="A generation no worker takes within this many seconds ends with "
            "an `error` event (`queue_timeout`).",
        ),
    ] = 120.0
    wait_replicas: Annotated[
        int,
        _D(
            ge=0,
            description="Replicas that must hold a request's submit before the client is "
            "answered (`WAIT`, after the submit's writes): a failover then cannot lose a "
            "request the client was told of. 0: none (Redis's own asynchronous "
            "replication).",
        ),
    ] = 0
    wait_aof: Annotated[
        bool,
        _D(
            description="The primary's AOF must hold a request's submit on disk before the "
            "client is answered (`WAITAOF`): a crash of Redis then cannot lose it "
            "(`appendfsync everysec` may lose its last second).",
        ),
    ] = False
    wait_timeout_ms: Annotated[
        int,
        _D(
            ge=1,
            description="How long a submit waits for `wait_replicas` / `wait_aof`; past it, "
            "it is answered anyway (logged): a replica that is down does not stop service.",
        ),
    ] = 200
    cancel_wait_s: Annotated[
        float, _D(ge=0, description="How long a cancel request waits for the final event.")
    ] = 5.0
    api_keys: Annotated[
        str,
        _D(
            description="Comma-separated Bearer keys for the API endpoints and for creating "
            "sessions; empty: open."
        ),
    ] = ""
    api_keys_file: Annotated[
        str,
        _D(
            description="A file with one Bearer key per line (added to api_keys), read at "
            "start-up; missing or empty: the gateway does not start."
        ),
    ] = ""
    admin_key: Annotated[
        str,
        _D(
            description="The Bearer key of the admin API (`/v1/admin/keys`, "
            "`/v1/admin/usage`: keys made, changed and revoked at run time, and their "
            "usage); set, every API endpoint wants a key; empty: no admin API."
        ),
    ] = ""
    cors_origins: Annotated[
        str, _D(description="Comma-separated origins allowed by CORS; empty: same origin only.")
    ] = ""
    web_dir: Annotated[str, _D(description="Folder of the static web chat served at /.")] = str(
        Path(__file__).resolve().parents[2] / "web"
    )
    log_level: Annotated[str, _D(description="DEBUG, INFO, WARNING or ERROR.")] = "INFO"
    log_format: Annotated[
        Literal["text", "json"],
        _D(
            description="`text`: key=value lines; `json`: one JSON object per line, for a "
            "log store (the same fields; docs/operations.md)."
        ),
    ] = "text"
    keepalive_s: Annotated[
        int,
        _D(
            ge=1,
            description="How long an idle HTTP keep-alive connection stays open. Longer than "
            "the idle timeout of common proxies and client pools (60 s), so a client never "
            "sends a request on a connection the gateway is closing.",
        ),
    ] = 75
    shutdown_grace_s: Annotated[
        int,
        _D(
            ge=0,
            description="On SIGTERM, how long open streams may run to their generation's "
            "end before they are cut (clients resume elsewhere with Last-Event-ID).",
        ),
    ] = 30
    grpc_port: Annotated[
        int,
        _D(
            ge=0,
            le=65_535,
            description="Port of the KServe v2 / Triton gRPC inference service, on the HTTP "
            "server's host (`python -m gateway --grpc-port` overrides it); 0: no gRPC server.",
        ),
    ] = 8001
    max_takeovers: Annotated[
        int,
        _D(
            ge=0,
            description="How often one reply may be taken over by another worker (its "
            "worker lost or stopped), and how often a request may go back on the queue "
            "because its worker died before starting it; past either, it ends with `error` "
            "`worker_lost`.",
        ),
    ] = 3

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        raw: dict[str, Any] = {}
        for name in cls.__struct_fields__:
            key = name.upper() if name in UNPREFIXED else ENV_PREFIX + name.upper()
            if key in env:
                raw[name] = env[key]
        return msgspec.convert(raw, cls, strict=False)

    @property
    def requests_maxlen(self) -> int:
        """The cap of each model's requests stream (approximate, whole nodes)."""
        return self.max_inflight * 20

    def cors_origin_list(self) -> list[str]:
        return [origin.strip() for origin in self.cors_origins.split(",") if origin.strip()]


def env_name(field: str) -> str:
    return field.upper() if field in UNPREFIXED else ENV_PREFIX + field.upper()


def markdown_table() -> str:
    """The configuration table, as docs/configuration.md shows it."""
    info = msgspec.inspect.type_info(Settings)
    assert isinstance(info, msgspec.inspect.StructType)
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    defaults = Settings()
    for field in info.fields:
        schema = getattr(field.type, "extra_json_schema", None) or {}
        meaning = schema.get("description", "")
        default = getattr(defaults, field.name)
        if field.name == "web_dir":
            default = "<repo>/web"
        shown = f"`{default!s}`" if str(default) else "(empty)"
        rows.append(f"| `{env_name(field.name)}` | {shown} | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())

"""``python -m gateway keys ...``: the admin API's keys and usage from a shell, straight on
Redis (``REDIS_URL``, ``TOKENSPOUT_KEY_PREFIX``), through the same keys store.

    python -m gateway keys create acme --models SmolLM2-135M-Instruct --rpm 60 --weight 2
    python -m gateway keys list
    python -m gateway keys show k_0123456789abcdef
    python -m gateway keys update k_0123456789abcdef --tpm 100000 --name acme-prod
    python -m gateway keys revoke k_0123456789abcdef
    python -m gateway keys usage k_0123456789abcdef --granularity day --start 2026-05-01

Each prints JSON, as the admin API answers (``create``: with the secret, shown this once).
A change is in force on every gateway within a second. Exit status 1 with a one-line
message for what cannot be done (an unknown key, a wrong value).

Without ``REDIS_URL``, the Redis of a running ``make run`` is used: it writes its URL to
``~/.cache/tokenspout/stack.env`` (``TOKENSPOUT_STACK_ENV``) while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
from redis.exceptions import RedisError

from gateway.apis.admin.views import KeyList, KeyView, usage_report
from gateway.core.settings import Settings
from gateway.tenants.keystore import KeyStore, TenantsError
from gateway.tenants.records import KeyChange, NewKey
from wire import Keys
from wire.connect import connect

STACK_ENV_VAR = "TOKENSPOUT_STACK_ENV"
STACK_PID = "TOKENSPOUT_STACK_PID"


def stack_env_path() -> Path:
    """Where ``make run`` (``python -m stack``) writes the ``REDIS_URL`` it runs on."""
    given = os.environ.get(STACK_ENV_VAR)
    return Path(given) if given else Path.home() / ".cache" / "tokenspout" / "stack.env"


def running_stack_env() -> dict[str, str]:
    """What a running ``make run`` wrote (``REDIS_URL``, maybe ``TOKENSPOUT_KEY_PREFIX``);
    nothing when none runs (no file, or the file of one that was killed)."""
    try:
        lines = stack_env_path().read_text().splitlines()
    except OSError:
        return {}
    found = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    try:
        os.kill(int(found.get(STACK_PID, "")), 0)
    except (ValueError, ProcessLookupError, PermissionError):
        return {}
    return found


LIMIT_FLAGS = {
    "concurrent": "concurrent",
    "rpm": "requests_per_minute",
    "tpm": "tokens_per_minute",
    "tpd": "tokens_per_day",
}
"""The flags of a key's limits -> their names in its record (0: none)."""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway keys", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("create", help="make a key; prints its secret, once")
    create.add_argument("name")
    _key_flags(create)
    commands.add_parser("list", help="every key, revoked ones too")
    for name, what in (("show", "one key"), ("revoke", "revoke a key (its usage stays)")):
        commands.add_parser(name, help=what).add_argument("id")
    update = commands.add_parser("update", help="change a key (what is not given stays)")
    update.add_argument("id")
    update.add_argument("--name")
    _key_flags(update)
    usage = commands.add_parser("usage", help="a key's usage per UTC hour or day")
    usage.add_argument("id", help="a key's id, a static key's (static-...), or anonymous")
    usage.add_argument("--start", help="unix seconds or ISO 8601 (default: a day or 30 ago)")
    usage.add_argument("--end", help="unix seconds or ISO 8601 (default: now)")
    usage.add_argument("--granularity", choices=["hour", "day"], default="hour")
    return parser


def _key_flags(command: argparse.ArgumentParser) -> None:
    command.add_argument("--models", help="comma-separated models it may use ('': every one)")
    command.add_argument("--weight", type=float, help="its share of the engine (default 1)")
    for flag, limit in LIMIT_FLAGS.items():
        command.add_argument(f"--{flag}", type=int, help=f"{limit} (0: none)")


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The key's fields the flags give (what an update changes)."""
    given: dict[str, Any] = {}
    if getattr(args, "name", None) is not None:
        given["name"] = args.name
    if args.models is not None:
        given["models"] = [name.strip() for name in args.models.split(",") if name.strip()]
    if args.weight is not None:
        given["weight"] = args.weight
    limits = {
        limit: getattr(args, flag)
        for flag, limit in LIMIT_FLAGS.items()
        if getattr(args, flag) is not None
    }
    if limits:
        given["limits"] = limits
    return given


async def run(args: argparse.Namespace, store: KeyStore) -> msgspec.Struct:
    match args.command:
        case "create":
            record, secret = await store.create(msgspec.convert(_given(args), NewKey))
            return KeyView.of(record, secret)
        case "list":
            return KeyList([KeyView.of(record) for record in await store.all()])
        case "show":
            return KeyView.of(await store.get(args.id))
        case "update":
            change = msgspec.convert(_given(args), KeyChange)
            return KeyView.of(await store.update(args.id, change))
        case "revoke":
            return KeyView.of(await store.revoke(args.id))
    return await usage_report(store, args.id, args.granularity, args.start, args.end)


async def _main(args: argparse.Namespace, settings: Settings) -> msgspec.Struct:
    redis = connect(settings.redis_url)
    try:
        return await run(args, KeyStore(redis, Keys(settings.key_prefix)))
    finally:
        await redis.aclose()


def _settings() -> Settings:
    """The environment's settings; without ``REDIS_URL``, a running ``make run``'s Redis."""
    settings = Settings.from_env()
    stack = {} if "REDIS_URL" in os.environ else running_stack_env()
    if "REDIS_URL" in stack:
        prefix = os.environ.get("TOKENSPOUT_KEY_PREFIX") or stack.get("TOKENSPOUT_KEY_PREFIX")
        found = {"redis_url": stack["REDIS_URL"], **({"key_prefix": prefix} if prefix else {})}
        settings = msgspec.structs.replace(settings, **found)
    return settings


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    settings = _settings()
    try:
        answer = asyncio.run(_main(args, settings))
    except (TenantsError, msgspec.ValidationError) as exc:
        sys.exit(f"tokenspout keys: {exc}")
    except (RedisError, OSError) as exc:
        sys.exit(
            f"tokenspout keys: Redis at {settings.redis_url} did not answer ({exc}); set "
            f"REDIS_URL to the gateway's Redis (a running make run writes its own to "
            f"{stack_env_path()})"
        )
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(answer)).decode() + "\n")

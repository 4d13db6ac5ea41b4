"""``python -m bench.redis_cost REV REV...``: what one one-shot request's scripts cost Redis,
in CPU instructions, on each revision (bench/checkouts.py): a count that no noisy
neighbour moves, where CPU time on these machines swings by a fifth between rounds.

Each revision's gateway and engine worker (bench/rig.py, the synthetic engine unpaced) serve
one streamed chat completion of one token with no API key while ``MONITOR`` records the
calls that carry it: the gateway's ``SUBMIT``, the worker's take (``FAIR_TAKE``, or an older
revision's ``XREADGROUP``) and its ``EMIT_STEP``, each with every argument. Those calls, the
revision's own scripts (``FUNCTION DUMP``; an older revision's ``SCRIPT SHOW``) and a fresh
``valkey-server`` under valgrind's callgrind then replay the request ``--requests`` times
(new session and generation ids each time, the entry id the take read passed on to the
step), callgrind counting only while one kind of call runs: the instructions Redis runs per
call of each (its scripts' inner commands, the Lua, reading the command and writing the
reply). A take reads one request here; under load one take reads several.

Needs valgrind (``apt install valgrind``). Results: NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bench import checkouts, report, requests
from bench.loadgen import sse_request
from bench.rig import rig
from bench.runner import chat_body
from stack.redis_server import server_binary
from stack.rig import HOST

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("submit", "take", "step")
"""The calls of one request, in its order: the gateway's SUBMIT, the worker's take, its
EMIT_STEP."""
GROUP = "engines"
"""The workers' consumer group (wire.queue.CONSUMER_GROUP, the same in every revision)."""
ENTRY_ID = re.compile(rb"^\d+-\d+$")
QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b"}


def say(message: str) -> None:
    print(f"[bench.redis_cost] {message}", file=sys.stderr, flush=True)


def monitor_words(line: str) -> list[bytes]:
    """A ``MONITOR`` line's command and arguments, unquoted byte for byte."""
    words = []
    for quoted in QUOTED.findall(line.split("] ", 1)[1]):
        word, i = bytearray(), 0
        while i < len(quoted):
            if quoted[i] != "\\":
                word += quoted[i].encode("latin-1")
                i += 1
            elif quoted[i + 1] == "x":
                word.append(int(quoted[i + 2 : i + 4], 16))
                i += 4
            else:
                word += ESCAPES.get(quoted[i + 1], quoted[i + 1].encode())
                i += 2
        words.append(bytes(word))
    return words


@dataclass
class Capture:
    """One request's calls as a revision made them, and its scripts to load elsewhere."""

    calls: dict[str, list[bytes]]
    """Role -> the call, command first."""
    functions: bytes | None
    """``FUNCTION DUMP`` of its library (None: a revision of EVALSHA scripts)."""
    scripts: list[bytes]
    """The bodies of the scripts it called with EVALSHA."""


FILES = {"submit": "submit", "take": "fair_take", "step": "emit_step"}
"""Role -> the file of wire/lua/ a library's function of it runs."""


def role_of(words: list[bytes]) -> str | None:
    """Which of one request's calls ``words`` is (None: none of them)."""
    command = words[0].upper()
    if command == b"XREADGROUP":
        return "take"
    if command not in (b"FCALL", b"EVALSHA") or len(words) < 4:
        return None
    if command == b"FCALL":  # a library's function is "<library>_<file>"
        name = words[1].decode()
        return next((role for role, file in FILES.items() if name.endswith(f"_{file}")), None)
    keys = words[3 : 3 + int(words[2])]
    if any(key.endswith(b":history") for key in keys) and any(b":gen:" in key for key in keys):
        # SUBMIT's keys begin with the session's meta; EMIT_STEP's with its events.
        return "submit" if keys[0].endswith(b":meta") else "step"
    return None


async def capture(checkout: checkouts.Checkout, logs: Path) -> Capture:
    """``checkout``'s processes serve one request while ``MONITOR`` watches."""
    async with rig(0, logs, root=checkout.root) as the_rig:
        server = next(iter(the_rig.servers.values()))
        body = chat_body(the_rig, 1)
        request = sse_request(HOST, the_rig.gateway_port, "/v1/chat/completions", {}, body)
        await requests.send(the_rig.gateway_port, request, 20, 1, kept=False)  # scripts load
        reader, writer = await asyncio.open_connection(HOST, server.port)
        writer.write(b"MONITOR\r\n")
        await reader.readline()
        outcomes = await requests.send(the_rig.gateway_port, request, 1, 1, kept=False)
        await asyncio.sleep(0.5)  # the worker's acknowledgement
        writer.close()
        seen = (await reader.read(1 << 24)).decode("latin-1")
        if any(o.failure for o in outcomes):
            raise RuntimeError(f"{checkout.label}: the request failed: {outcomes}")
        calls: dict[str, list[bytes]] = {}
        for line in seen.split("\r\n"):
            if "] " in line and (role := role_of(words := monitor_words(line))) is not None:
                calls.setdefault(role, words)
        if set(calls) != set(ROLES):
            raise RuntimeError(f"{checkout.label}: saw {sorted(calls)} of {ROLES}")
        client = server.client
        if calls["submit"][0].upper() == b"FCALL":
            return Capture(calls, await client.function_dump(), [])
        shas = {calls[role][1] for role in ("submit", "step")}
        shown = [await client.execute_command("SCRIPT", "SHOW", sha) for sha in shas]  # type: ignore[no-untyped-call]
        return Capture(calls, None, shown)


class Callgrind:
    """A ``valkey-server`` under callgrind, counting only between ``on`` and ``off``, on a
    Unix socket of its own folder (no port to share with another process's server)."""

    START_S = 60.0

    def __init__(self, out: Path) -> None:
        self.out = out
        socket = out.parent / "valkey.sock"
        self.process = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                str(server_binary()),
                *("--port", "0", "--unixsocket", str(socket), "--unixsocketperm", "700"),
                *("--dir", str(out.parent), "--save", "", "--appendonly", "no"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # A call sent twice would not be the request replayed: under callgrind on a busy
        # machine one may take longer than redis-py's 5 s, which it would then send again.
        self.client = redis.Redis(
            unix_socket_path=str(socket), socket_timeout=None, retry=Retry(NoBackoff(), 0)
        )
        deadline = time.monotonic() + self.START_S
        while not self._answers(socket):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"valkey-server under callgrind did not start ({socket})")
            time.sleep(0.1)

    def _answers(self, socket: Path) -> bool:
        if not socket.exists():
            return False
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:  # the socket is made a moment before it accepts
            return False

    def control(self, *args: str) -> None:
        subprocess.run(
            ["callgrind_control", *args, str(self.process.pid)], check=True, capture_output=True
        )

    def counted(self) -> int:
        """Instructions counted since the last call (callgrind dumps and starts again)."""
        for old in self.out.parent.glob(f"{self.out.name}.*"):
            old.unlink()
        self.control("-d")
        dumped = next(self.out.parent.glob(f"{self.out.name}.*"))
        for line in dumped.read_text().splitlines():
            if line.startswith("summary:") or line.startswith("totals:"):
                return int(line.split()[1])
        raise RuntimeError(f"no totals in {dumped}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


class Replay:
    """One captured request sent again and again, each time a new one."""

    def __init__(self, captured: Capture, client: redis.Redis) -> None:
        self.calls = captured.calls
        self.client = client
        submit = self.calls["submit"]
        keys = submit[3 : 3 + int(submit[2])]
        gen = next(key for key in keys if b":gen:" in key)
        self.gid = gen.rsplit(b":", 1)[1]
        self.sid = re.search(rb"\{(s_[^}]+)\}", gen).group(1)  # type: ignore[union-attr]
        self.entry = next(w for w in self.calls["step"] if ENTRY_ID.match(w))
        take = self.calls["take"]
        words = [w.upper() for w in take]
        if take[0].upper() == b"XREADGROUP" and b"BLOCK" in words:
            at = words.index(b"BLOCK")  # nothing to wait for here
            take, words = take[:at] + take[at + 2 :], words[:at] + words[at + 2 :]
            self.calls["take"] = take
        stream = take[words.index(b"STREAMS") + 1] if b"STREAMS" in words else take[3]
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)

    def one(self, around: Any = None) -> None:
        """One request's calls; ``around(role, call)`` runs each (None: as it is)."""
        fresh = {
            self.gid: b"g_" + secrets.token_urlsafe(16).encode(),
            self.sid: b"s_" + secrets.token_urlsafe(16).encode(),
        }
        for role in ROLES:
            words = [self.renamed(word, fresh) for word in self.calls[role]]
            reply = around(role, words) if around else command(self.client, words)
            if role == "submit" and not (isinstance(reply, list) and reply[:1] == [b"ok"]):
                raise RuntimeError(f"SUBMIT queued nothing: it answered {reply!r}")
            if role == "take":
                try:
                    fresh[self.entry] = first_entry_id(reply)
                except LookupError:
                    raise RuntimeError(f"the take read no request: it answered {reply!r}") from None

    @staticmethod
    def renamed(word: bytes, fresh: dict[bytes, bytes]) -> bytes:
        for old, new in fresh.items():
            word = word.replace(old, new)
        return word


def command(client: redis.Redis, words: list[bytes]) -> Any:
    return client.execute_command(*words)  # type: ignore[no-untyped-call]


def first_entry_id(reply: Any) -> bytes:
    """The id of the first stream entry in a take's reply, however it nests it."""
    if isinstance(reply, bytes) and ENTRY_ID.match(reply):
        return reply
    items = reply.values() if isinstance(reply, dict) else reply
    for item in items if isinstance(items, (list, tuple, type({}.values()))) else ():
        try:
            return first_entry_id(item)
        except LookupError:
            continue
    raise LookupError("no entry in the take's reply")


def measure(captured: Capture, n: int, scratch: Path) -> dict[str, float]:
    """Instructions per call of each role, and per whole request, over ``n`` requests."""
    server = Callgrind(scratch / "callgrind.out")
    try:
        client = server.client
        if captured.functions is not None:
            client.function_restore(captured.functions)  # type: ignore[arg-type]
        for body in captured.scripts:
            client.script_load(body)
        replay = Replay(captured, client)
        for _ in range(50):  # the session keys, the streams, the Lua state settle
            replay.one()
        server.control("-i", "on")
        server.counted()
        for _ in range(n):
            replay.one()
        whole = server.counted()
        server.control("-i", "off")
        per: dict[str, float] = {"request": whole / n}
        calls = max(1, n // 10)  # a toggle takes callgrind a fifth of a second
        idle = 0  # what Redis runs meanwhile with no call (its timers): taken off each
        for _ in range(calls):
            server.control("-i", "on")
            server.counted()
            idle += server.counted()
            server.control("-i", "off")
        for role in ROLES:
            counted = 0

            def around(name: str, words: list[bytes], role: str = role) -> Any:
                nonlocal counted
                if name != role:
                    return command(client, words)
                server.control("-i", "on")
                server.counted()
                reply = command(client, words)
                counted += server.counted()
                server.control("-i", "off")
                return reply

            for _ in range(calls):
                replay.one(around)
            per[role] = (counted - idle) / calls
        return per
    finally:
        server.stop()


INNER = {
    "TIME": "redis.call('TIME')",
    "EXISTS": "redis.call('EXISTS', 'gen')",
    "HGET": "redis.call('HGET', 'free', 'w1')",
    "HGETALL (one field)": "redis.call('HGETALL', 'free')",
    "HSET (one field)": "redis.call('HSET', 'h', 'a', '1')",
    "HDEL (none there)": "redis.call('HDEL', 'weights', 'anonymous')",
    "EXPIRE": "redis.call('EXPIRE', 'h', 600)",
    "SMEMBERS (one member)": "redis.call('SMEMBERS', 'holders')",
    "LLEN": "redis.call('LLEN', 'bell')",
    "XADD (an event)": "redis.call('XADD', 'events', 'MAXLEN', '~', 20000, '*', 't', 'token',"
    " 'g', 'g_JB8vNYGGrV_0bbXSuOLL4Q', 'd', ARGV[1])",
    "PUBLISH (no subscriber)": "redis.call('PUBLISH', 'live', ARGV[1])",
    "XINFO GROUPS (one group)": "redis.pcall('XINFO', 'GROUPS', 'requests')",
    "string.match, 3 captures": "string.match('11996 1796099493 1', '^(%d+) (%d+) ([01])$')",
    "tonumber": "tonumber(ARGV[2])",
}
"""What one inner call of a script costs, each run in a loop inside one FCALL: a script's
price list (a token event's JSON for ARGV[1])."""
EVENT = b'{"type":"token","generation_id":"g_JB8vNYGGrV_0bbXSuOLL4Q","text":"You","count":1}'


def inner_costs(scratch: Path, loops: int = 2000) -> dict[str, float]:
    """Instructions per inner call of each of ``INNER``, the empty loop's taken off."""
    server = Callgrind(scratch / "inner.out")
    try:
        client = server.client
        client.hset("free", "w1", "11996 1796099493 1")
        client.sadd("holders", "w1")
        client.rpush("bell", 1)
        client.xgroup_create("requests", GROUP, id="0", mkstream=True)
        bodies = {"": "", **INNER}
        code = "#!lua name=inner\n" + "".join(
            f"redis.register_function('inner_{i}', function(KEYS, ARGV)"
            f" for _ = 1, {loops} do {body} end return 1 end)\n"
            for i, body in enumerate(bodies.values())
        )
        client.function_load(code)
        counted = []
        for i in range(len(bodies)):
            server.control("-i", "on")
            server.counted()
            client.fcall(f"inner_{i}", 0, EVENT, "1796099493")
            counted.append(server.counted())
            server.control("-i", "off")
        return {name: (c - counted[0]) / loops for name, c in zip(INNER, counted[1:], strict=True)}
    finally:
        server.stop()


async def one_revision(checkout: checkouts.Checkout, args: argparse.Namespace) -> dict[str, Any]:
    logs = args.logs / checkout.commit[:12]
    logs.mkdir(parents=True, exist_ok=True)
    captured = await capture(checkout, logs)
    with tempfile.TemporaryDirectory(prefix="redis-cost-") as scratch:
        per = await asyncio.to_thread(measure, captured, args.requests, Path(scratch))
    take = captured.calls["take"][0].decode().upper()
    say(
        f"{checkout.label}: {per['request'] / 1000:,.0f} k instructions a request"
        f" (SUBMIT {per['submit'] / 1000:,.0f} k, take {per['take'] / 1000:,.0f} k,"
        f" EMIT_STEP {per['step'] / 1000:,.0f} k)"
    )
    return {"commit": checkout.commit, "take": take, "instructions": per}


def markdown(results: dict[str, Any]) -> str:
    revisions = results["revisions"]
    base = next(iter(revisions.values()))["instructions"]
    out = [
        "# What one one-shot request's scripts cost Redis (python -m bench.redis_cost)",
        "",
        f"Thousands of CPU instructions Redis ran (valgrind's callgrind), per call, replaying"
        f" one streamed chat completion of one token with no API key {results['requests']}"
        " times, one after another (a take reads one request here). 'request': the whole of"
        " one, its three calls and what Redis does between them. In brackets: against the"
        " first revision.",
        "",
        "| revision | SUBMIT | take | EMIT_STEP | request |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, seen in revisions.items():
        per = seen["instructions"]
        cells = [
            f"{per[key] / 1000:,.0f} ({per[key] / base[key]:.2f})" for key in (*ROLES, "request")
        ]
        out.append(f"| {label} ({seen['take']} take) | " + " | ".join(cells) + " |")
    out += [
        "",
        "What one call made inside a script costs (instructions; each in a loop inside one"
        " FCALL, the empty loop's taken off): the script's Lua and the command together.",
        "",
        "| inner call | instructions |",
        "| --- | --- |",
        *(f"| {name} | {cost:,.0f} |" for name, cost in results["inner"].items()),
    ]
    return "\n".join(out) + "\n"


async def measured(args: argparse.Namespace) -> dict[str, Any]:
    """Each revision's request, then the inner calls' price list (this checkout's Redis)."""
    revisions = [checkouts.checkout(ref, args.scratch) for ref in args.revisions]
    seen = {checkout.label: await one_revision(checkout, args) for checkout in revisions}
    with tempfile.TemporaryDirectory(prefix="redis-cost-") as scratch:
        inner = await asyncio.to_thread(inner_costs, Path(scratch))
    return {"requests": args.requests, "revisions": seen, "inner": inner}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_cost", description=__doc__)
    parser.add_argument("revisions", nargs="+", help="commits, branches, tags; '.': this checkout")
    parser.add_argument("--requests", type=int, default=300, help="replayed, one at a time")
    parser.add_argument("--scratch", type=Path, default=checkouts.SCRATCH)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--name", default="redis-cost")
    parser.add_argument("--logs", type=Path, default=None)
    report.run(parser.parse_args(argv), measured, markdown, say)


if __name__ == "__main__":
    main()

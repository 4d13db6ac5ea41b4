"""``python -m bench.commands REV REV...``: every Redis command and script one one-shot
request makes, by process, on each revision (bench/checkouts.py).

Each revision's gateway and engine worker (bench/rig.py, the synthetic engine unpaced) serve
``--requests`` streamed chat completions of one token, one after another, while Redis's
``MONITOR`` lists every command: a script's call by the file of wire/lua/ it runs
(``FCALL``: the function's name ends with it; ``EVALSHA``: ``SCRIPT SHOW``), the commands
it makes inside listed under it; each command by the
process whose connection sent it (its local port, from /proc). Per request: the count of
each, over the requests (a figure well under one is background: heartbeats, the reaper,
the key directory's poll). With no API key, and with a key that has every limit set and a
weight (made by the revision's own ``python -m gateway keys``; a revision with no keys has
no such side). Results: NAME.json and NAME.md (the tables; what each command is for is
docs/bench/request-commands.md's).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
from pathlib import Path
from typing import Any

from bench import checkouts, report, requests, stuck
from bench.checkouts import Checkout
from bench.loadgen import sse_request
from bench.rig import Rig, rig, run_logs
from bench.runner import chat_body
from stack import procfs
from stack.rig import HOST

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS = {"CLIENT", "XINFO", "SCRIPT", "CONFIG", "OBJECT", "XGROUP", "FUNCTION"}
"""Commands named by their subcommand too."""
SETTLE_S = 0.5
"""After the last reply, how long the worker's acknowledgement and counts may take."""


def say(message: str) -> None:
    print(f"[bench.commands] {message}", file=sys.stderr, flush=True)


def command_name(words: str) -> str:
    parts = words.split(" ", 2)
    if parts[0].upper() in CONTAINERS and len(parts) > 1:
        return f"{parts[0].upper()} {parts[1].upper()}"
    return parts[0].upper()


class Ledger:
    """What ``MONITOR`` showed, by process: each command's count, a script's under its
    name with the commands it made inside."""

    def __init__(self, ports: dict[int, str], scripts: dict[str, str]) -> None:
        self.ports = ports
        self.scripts = scripts
        self.calls: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.inside: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self._script: str | None = None

    def add(self, line: dict[str, Any]) -> None:
        words: str = line["command"]
        if line["client_type"] == "lua":
            self.inside[self._script or "?"][command_name(words)] += 1
            return
        process = self.ports.get(int(line["client_port"] or 0), "other")
        name = command_name(words)
        if name in ("EVALSHA", "EVAL", "FCALL"):
            called = words.split(" ", 2)[1]
            name = f"{name} {self.scripts.get(called, called[:8])}"
            self._script = name
        self.calls[process][name] += 1

    def per_request(self, n: int) -> dict[str, Any]:
        return {
            "calls": {
                process: {name: round(count / n, 2) for name, count in counts.most_common()}
                for process, counts in sorted(self.calls.items())
            },
            "inside": {
                script: {name: round(count / self.calls_of(script), 2) for name, count in c.items()}
                for script, c in sorted(self.inside.items())
            },
        }

    def calls_of(self, script: str) -> int:
        return sum(counts[script] for counts in self.calls.values()) or 1


async def script_names(the_rig: Rig, root: Path, lines: list[dict[str, Any]]) -> dict[str, str]:
    """The function or SHA1 of each script called in ``lines`` -> the file of ``root``'s
    wire/lua/ it runs: a library's function is named "<library>_<file>"; a script's body
    ends with its file (the shared cores come first)."""
    client = next(iter(the_rig.servers.values())).client
    files = {p.stem: p.read_text().rstrip() for p in (root / "wire" / "lua").glob("*.lua")}
    called = [line["command"].split(" ", 2) for line in lines]
    names = {
        words[1]: max((f for f in files if words[1].endswith(f"_{f}")), key=len, default=words[1])
        for words in called
        if words[0] == "FCALL" and len(words) > 1
    }
    shas = {words[1] for words in called if words[0] == "EVALSHA" and len(words) > 1}
    for sha in shas:
        shown = await client.execute_command("SCRIPT", "SHOW", sha)  # type: ignore[no-untyped-call]
        body = shown.decode().rstrip()
        ends = [name for name, text in files.items() if body.endswith(text)]
        names[sha] = max(ends, key=lambda name: len(files[name]), default=sha[:8])
    return names


def processes_by_port(the_rig: Rig) -> dict[int, str]:
    """Each local port connected to Redis -> the process that holds it."""
    port = next(iter(the_rig.servers.values())).port
    pids = the_rig.pids()
    out = {p: "bench" for p in procfs.tcp_local_ports_to(pids["loadgen"], port)}
    for name in ("gateway", "worker"):
        out |= {p: name for p in procfs.tcp_local_ports_to(pids[name], port)}
    return out


async def watch(the_rig: Rig, headers: dict[str, str] | None, n: int) -> list[dict[str, Any]]:
    """``MONITOR``'s lines while ``n`` one-shot requests go one after another."""
    client = next(iter(the_rig.servers.values())).client
    lines: list[dict[str, Any]] = []
    started = asyncio.Event()

    async def listen() -> None:
        async with client.monitor() as monitor:
            started.set()
            async for line in monitor.listen():
                lines.append(line)

    listening = asyncio.create_task(listen())
    await started.wait()
    body = chat_body(the_rig, 1)
    request = sse_request(HOST, the_rig.gateway_port, "/v1/chat/completions", headers or {}, body)
    outcomes = await requests.send(the_rig.gateway_port, request, n, 1, kept=True)
    await asyncio.sleep(SETTLE_S)
    listening.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await listening
    failed = [o.failure for o in outcomes if o.failure]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    return lines


async def one_revision(checkout: Checkout, args: argparse.Namespace) -> dict[str, Any]:
    logs = args.logs / checkout.commit[:12]
    logs.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    async with rig(0, logs, root=checkout.root) as the_rig:
        sides: dict[str, dict[str, str] | None] = {"anonymous": None}
        server = next(iter(the_rig.servers.values()))
        env = {
            "REDIS_URL": f"redis://{HOST}:{server.port}",
            "TOKENSPOUT_KEY_PREFIX": the_rig.prefix,
        }
        made = await asyncio.to_thread(checkouts.make_key, checkout.root, env, args.weight)
        if made is not None:
            await asyncio.sleep(1.0)  # a gateway reads the keys every 250 ms
            sides["keyed"] = {"Authorization": f"Bearer {made[1]}"}
        for kind, headers in sides.items():
            await watch(the_rig, headers, 20)  # not counted: the scripts load, pools fill
            lines = await watch(the_rig, headers, args.requests)
            names = await script_names(the_rig, checkout.root, lines)
            ledger = Ledger(processes_by_port(the_rig), names)
            for line in lines:
                ledger.add(line)
            out[kind] = ledger.per_request(args.requests)
            calls = sum(sum(c.values()) for c in ledger.calls.values())
            say(f"{checkout.label}, {kind}: {calls / args.requests:.1f} calls a request")
    return out


def markdown(results: dict[str, Any]) -> str:
    out = [
        "# Redis commands of one one-shot request (python -m bench.commands)",
        "",
        f"{results['requests']} streamed chat completions of one token, one after another;"
        " per request, by process. A script's inner commands are per call of it.",
    ]
    for label, kinds in results["revisions"].items():
        for kind, seen in kinds.items():
            out += [
                "",
                f"## {label}, {kind}",
                "",
                "| process | command or script | per request | inside (per call) |",
                "| --- | --- | --- | --- |",
            ]
            for process, calls in seen["calls"].items():
                for name, count in calls.items():
                    inner = seen["inside"].get(name, {})
                    inside = ", ".join(f"{c} {k:g}" for c, k in sorted(inner.items()))
                    out.append(f"| {process} | {name} | {count:g} | {inside} |")
    return "\n".join(out) + "\n"


async def suite(args: argparse.Namespace) -> dict[str, Any]:
    revisions = [checkouts.checkout(ref, args.scratch) for ref in args.revisions]
    results: dict[str, Any] = {"requests": args.requests, "revisions": {}}
    for checkout in revisions:
        results["revisions"][checkout.label] = await one_revision(checkout, args)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.commands", description=__doc__)
    parser.add_argument("revisions", nargs="+", help="commits, branches, tags; '.': this checkout")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--weight", type=float, default=2.0, help="the key's weight")
    parser.add_argument("--scratch", type=Path, default=checkouts.SCRATCH)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--name", default="request-commands-counted")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.logs = run_logs("commands", None, say)
    results = stuck.run(suite(args))
    report.write(args.out, args.name, results, markdown(results))
    say(f"done: {args.out}/{args.name}.md")


if __name__ == "__main__":
    main()

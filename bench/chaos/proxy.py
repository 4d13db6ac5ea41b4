"""A TCP proxy that breaks connections on demand, the network between the processes of a
chaos run: one listener in front of each Redis server (every gateway and worker reaches
Redis through it), and one in front of each gateway port (the run's clients reach the
gateways through it).

A fault strikes the links of a ``Scope``: those some processes opened (found by their
sockets in /proc, so a fault on a worker strikes its connections to every Redis node and
no other process's), or those of some listeners (a share of them, picked at random); and,
while the fault lasts, the links the scope opens meanwhile.

- ``blackhole``: nothing passes either way for ``held_s``; then what was held goes on, in
  order: a partition that heals before TCP gives up (the kernels' buffers hold what was
  sent; neither end sees an error).
- ``oneway``: the same in one direction only: ``up`` (to the server: a command waits, the
  answers to those sent before still come) or ``down`` (to the client: commands run, their
  answers wait).
- ``latency``: every chunk passes ``delay_s`` late, for ``held_s``.
- ``reset``: the links close at once with an RST to both ends, as a middlebox that lost
  their state answers the next packet.

``python -m bench.chaos.proxy --route LISTEN:UPSTREAM ...`` serves the routes and takes
faults as JSON lines on a control port (``ProxyControl`` is its client); it prints
``{"control": PORT}`` once it listens. ``FaultProxy`` is the same in-process (its tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import struct
import sys
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from stack import procfs

HOST = "127.0.0.1"
HOWS = ("blackhole", "oneway", "latency", "reset")
DIRECTIONS = ("up", "down")
CHUNK = 65_536


@dataclass
class Valve:
    """What one direction of a link lets through now: held until a time, or late by
    ``delay_s`` until a time (the loop's clock)."""

    held_until: float = 0.0
    delay_s: float = 0.0
    delayed_until: float = 0.0

    async def passage(self, read_at: float) -> None:
        """Wait until a chunk read at ``read_at`` may be written on."""
        loop = asyncio.get_running_loop()
        while (now := loop.time()) < self.held_until:
            await asyncio.sleep(self.held_until - now)
        if read_at < self.delayed_until and (due := read_at + self.delay_s) > now:
            await asyncio.sleep(due - now)


@dataclass(eq=False)
class Link:
    """One client connection through a listener, and its connection to the upstream."""

    listener: int
    peer_port: int
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    pipes: int = 2
    """Directions still open: the link is gone once both ended."""
    valves: dict[str, Valve] = field(default_factory=lambda: {d: Valve() for d in DIRECTIONS})

    def hold(self, directions: tuple[str, ...], until: float) -> None:
        for direction in directions:
            self.valves[direction].held_until = max(self.valves[direction].held_until, until)

    def delay(self, delay_s: float, until: float) -> None:
        for valve in self.valves.values():
            valve.delay_s, valve.delayed_until = delay_s, until

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.close()

    def reset(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None and not writer.transport.is_closing():
                sock = writer.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()


@dataclass(frozen=True)
class Scope:
    """The links a fault strikes: those of the ``listeners`` (all when none is named)
    opened by the process trees of ``pids`` (any process when none is named), a ``share``
    of them."""

    pids: tuple[int, ...] = ()
    listeners: tuple[int, ...] = ()
    share: float = 1.0


@dataclass(frozen=True)
class Fault:
    how: str
    scope: Scope
    until: float
    delay_s: float = 0.0
    direction: str = ""

    def strike(self, link: Link) -> None:
        if self.how == "reset":
            link.reset()
        elif self.how == "latency":
            link.delay(self.delay_s, self.until)
        else:
            link.hold(DIRECTIONS if self.how == "blackhole" else (self.direction,), self.until)


class FaultProxy:
    """Listeners (listen port -> upstream port on loopback; 0 listens on a free port) whose
    links ``strike`` breaks."""

    def __init__(self, routes: dict[int, int], seed: int = 0) -> None:
        self.routes = dict(routes)
        self.links: set[Link] = set()
        self.faults: list[Fault] = []
        """Faults still lasting: a link opened meanwhile in their scope gets them too."""
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._rng = random.Random(seed)

    async def start(self) -> FaultProxy:
        for listen, upstream in list(self.routes.items()):
            server = await asyncio.start_server(
                lambda r, w, upstream=upstream: self._accept(r, w, upstream), HOST, listen
            )
            port = int(server.sockets[0].getsockname()[1])
            del self.routes[listen]
            self.routes[port] = upstream
            self._servers.append(server)
        return self

    def port_for(self, upstream: int) -> int:
        """The listen port in front of ``upstream``."""
        return next(listen for listen, up in self.routes.items() if up == upstream)

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for link in list(self.links):
            link.reset()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def strike(
        self, how: str, scope: Scope, held_s: float = 0.0, delay_s: float = 0.0, direction: str = ""
    ) -> int:
        """Break the links of ``scope`` (and, for ``held_s``, those it opens meanwhile);
        returns how many links it struck now."""
        if how not in HOWS or (how == "oneway" and direction not in DIRECTIONS):
            raise ValueError(f"no fault {how!r} {direction!r}: one of {HOWS}, up or down")
        fault = Fault(how, scope, asyncio.get_running_loop().time() + held_s, delay_s, direction)
        struck = self._in_scope(scope, list(self.links))
        if scope.share < 1.0:
            struck = [link for link in struck if self._rng.random() < scope.share]
        for link in struck:
            fault.strike(link)
        if how != "reset" and held_s > 0:
            self.faults.append(fault)
        return len(struck)

    def _in_scope(self, scope: Scope, links: list[Link]) -> list[Link]:
        listeners = set(scope.listeners or self.routes)
        links = [link for link in links if link.listener in listeners]
        if scope.pids:
            ports = procfs.tcp_local_ports(list(scope.pids), listeners)
            links = [link for link in links if link.peer_port in ports]
        return links

    def _lasting(self, link: Link) -> None:
        """A new link gets the faults its scope is under now."""
        now = asyncio.get_running_loop().time()
        self.faults = [fault for fault in self.faults if fault.until > now]
        for fault in self.faults:
            if self._in_scope(fault.scope, [link]):
                fault.strike(link)

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: int
    ) -> None:
        listener = int(writer.get_extra_info("sockname")[1])
        link = Link(listener, int(writer.get_extra_info("peername")[1]), writer)
        self.links.add(link)
        self._lasting(link)
        try:
            # A held link connects only once it may pass (a blackholed SYN goes nowhere).
            await link.valves["up"].passage(asyncio.get_running_loop().time())
            up_reader, link.upstream = await asyncio.open_connection(HOST, upstream)
        except OSError:  # the server is down: the client sees its connection reset
            link.reset()
            link.close()
            self.links.discard(link)
            return
        for source, sink, direction in (
            (reader, link.upstream, "up"),
            (up_reader, writer, "down"),
        ):
            task = asyncio.create_task(self._pipe(link, source, sink, link.valves[direction]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, link: Link, source: asyncio.StreamReader, sink: asyncio.StreamWriter, valve: Valve
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await source.read(CHUNK):
                await valve.passage(loop.time())
                if sink.transport.is_closing():
                    break
                sink.write(data)
                await sink.drain()
        except (ConnectionError, RuntimeError):
            # RuntimeError: uvloop refuses a write to a transport aborted meanwhile.
            link.reset()
        finally:
            link.pipes -= 1
            if not sink.transport.is_closing():
                with contextlib.suppress(OSError, RuntimeError):
                    sink.write_eof()  # a half close passes on as one
            if not link.pipes:
                self.links.discard(link)
                link.close()


# --- the proxy as a process, and its client ---------------------------------------------


def strike_command(
    how: str,
    *,
    pids: list[int] | None = None,
    listeners: list[int] | None = None,
    share: float = 1.0,
    held_s: float = 0.0,
    delay_s: float = 0.0,
    direction: str = "",
) -> dict[str, Any]:
    return {
        "how": how,
        "pids": pids or [],
        "listeners": listeners or [],
        "share": share,
        "held_s": held_s,
        "delay_s": delay_s,
        "direction": direction,
    }


def _strike(proxy: FaultProxy, command: dict[str, Any]) -> dict[str, Any]:
    scope = Scope(tuple(command["pids"]), tuple(command["listeners"]), command["share"])
    try:
        struck = proxy.strike(
            command["how"], scope, command["held_s"], command["delay_s"], command["direction"]
        )
    except ValueError as exc:
        return {"error": str(exc)}
    return {"links": struck}


async def serve(routes: dict[int, int], control_port: int) -> None:
    async with FaultProxy(routes) as proxy:

        async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while line := await reader.readline():
                writer.write(json.dumps(_strike(proxy, json.loads(line))).encode() + b"\n")
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(control, HOST, control_port)
        port = server.sockets[0].getsockname()[1]
        print(json.dumps({"control": port, "routes": proxy.routes}), flush=True)
        async with server:
            await server.serve_forever()


class ProxyControl:
    """The control connection to a proxy process: one strike at a time."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._lock = asyncio.Lock()
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def strike(self, how: str, **scope: Any) -> int:
        """``strike_command``'s arguments; returns the links struck."""
        async with self._lock:
            if self._stream is None:
                self._stream = await asyncio.open_connection(HOST, self.port)
            reader, writer = self._stream
            writer.write(json.dumps(strike_command(how, **scope)).encode() + b"\n")
            await writer.drain()
            answer = json.loads(await reader.readline())
        if "error" in answer:
            raise ValueError(answer["error"])
        return int(answer["links"])

    async def close(self) -> None:
        if self._stream is not None:
            self._stream[1].close()
            with contextlib.suppress(OSError):
                await self._stream[1].wait_closed()
            self._stream = None


def _route(text: str) -> tuple[int, int]:
    listen, _, upstream = text.partition(":")
    return int(listen), int(upstream)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.chaos.proxy", description=__doc__)
    parser.add_argument("--route", type=_route, action="append", required=True)
    parser.add_argument("--control-port", type=int, default=0)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(serve(dict(args.route), args.control_port))
    except KeyboardInterrupt:
        sys.exit(0)

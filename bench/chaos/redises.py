"""The Redis of a chaos run, behind the run's proxy (bench/chaos/network.py), and what it
suffers. Four kinds:

- ``single``: one server with AOF (``appendfsync everysec``, as compose.yaml runs it);
- ``volatile``: one server keeping nothing on disk (the embedded default);
- ``cluster``: 3 primaries with a replica each;
- ``sentinel``: a primary and a replica with AOF, watched by 3 Sentinels.

Every server is reached through a listener of the proxy (the cluster's nodes announce it,
the Sentinels name it), so a partition can cut one process off from all of them. Each
fault leaves Redis whole again: ``restart`` (SIGTERM: the AOF is written whole),
``crash`` (the host crashed: SIGKILL, and the AOF loses what its last ``fsync`` did not
cover, ``AofWatch``), ``wipe`` (back with nothing but the run's API keys, as an operator
provisions them), ``fail_over`` (a primary SIGKILLed, its replica promoted, the old one
back as a replica), ``pause`` (``CLIENT PAUSE WRITE``) and ``fill`` (``maxmemory`` just
above what it holds: writes refused with ``OOM``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.chaos.network import Proxy
from stack.redis_cluster import EmbeddedCluster
from stack.redis_sentinel import EmbeddedSentinel
from stack.redis_server import EmbeddedRedis, free_port
from stack.rig import sync_client
from wire import Keys

KINDS = ("single", "volatile", "cluster", "sentinel")
LOSES_WRITES = {
    "crash": "what the AOF's last fsync did not cover (appendfsync everysec: up to 1 s)",
    "wipe": "everything but the API keys",
    "fail_over": "what the replica had not received (replication is asynchronous)",
}
"""The faults after which Redis may lack writes it acknowledged, and which."""
FILL_MARGIN_BYTES = 64 * 1024
SENTINEL_DOWN_AFTER_MS = 5_000
"""The Sentinels' ``down-after-milliseconds`` under the run's load (30 s by default). At
the tests' 1 s, a primary just promoted was called down a second later, before the
Sentinels' first ping of it was answered on the loaded machine, and failed over again,
back to the old one just restarted (seed 1: a failover flapped between the two, its
victim never followed in 90 s, and writes were lost that no fault of the run's had
caused)."""
SENTINEL_FAILOVER_TIMEOUT_MS = 3_000
"""The Sentinels' ``failover-timeout``: a Sentinel starts no failover of a primary within
twice this of the last one it tried or voted for (the default's 20 s outlasted the gap
between two of the run's failovers: the new primary, killed 17 s after, was left down
until then, and clients refused all that time gave up). Nor does it try again sooner
after a try it gave up: the first often is, on this loaded machine (no replica fit to
promote: the Sentinels' last look at it, every 10 s until the primary is called down, is
too old), and the primary stays down that long more (16 s in all at 5 s). ``fail_over``
also waits twice this after its last kill (``fail_over_in_s``)."""
HOST = "127.0.0.1"


def _client(port: int) -> redis.Redis:
    return redis.Redis(host=HOST, port=port, socket_timeout=5)


def aof_incr_file(folder: Path) -> Path | None:
    """The AOF file of new writes of the server whose data folder is ``folder`` (the last
    one its manifest names), or None."""
    manifest = folder / "appendonlydir" / "appendonly.aof.manifest"
    with contextlib.suppress(OSError):
        names = [line.split()[1] for line in manifest.read_text().splitlines()]
        incr = [name for name in names if name.endswith(".incr.aof")]
        return folder / "appendonlydir" / incr[-1] if incr else None
    return None


class AofWatch:
    """What a server's AOF holds on disk as ``appendfsync everysec`` keeps it: the size of
    its file of new writes as of the last second. A SIGKILL loses nothing (the kernel holds
    what Redis wrote: measured, 8,456 increments acknowledged in 1.5 s, all back); a host
    that crashes loses what was written since the last fsync, which ``cut`` does to the
    file (Redis loads it up to its last whole command: ``aof-load-truncated``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._synced: tuple[Path, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="aof-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(1.0):  # everysec
            incr = aof_incr_file(self.folder)
            with contextlib.suppress(OSError):
                self._synced = (incr, incr.stat().st_size) if incr else None

    def cut(self) -> int:
        """Drop what the last fsync did not cover (the server is down); bytes dropped."""
        incr, synced = aof_incr_file(self.folder), self._synced
        if incr is None or synced is None or synced[0] != incr:
            return 0  # rewritten meanwhile: nothing known to drop
        size = incr.stat().st_size
        with incr.open("r+b") as file:
            file.truncate(min(size, synced[1]))
        return max(0, size - synced[1])

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Datastore:
    kind: str
    proxy: Proxy
    server: EmbeddedRedis | None = None
    cluster: EmbeddedCluster | None = None
    sentinel: EmbeddedSentinel | None = None
    provisioned: Path | None = None
    """An RDB file holding the run's API keys only (``provision``): a wiped Redis starts
    from it."""
    aof: AofWatch | None = None
    """The one server's AOF as its fsyncs keep it (``single``)."""
    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="chaos-redis-")))
    killed_at: float = -1e9
    """When ``fail_over`` last killed a Sentinel primary (monotonic)."""

    @property
    def url(self) -> str:
        """``REDIS_URL`` of the run's processes: through the proxy."""
        if self.cluster is not None:
            return self.cluster.url
        if self.sentinel is not None:
            return self.sentinel.url
        assert self.server is not None
        return f"redis://{HOST}:{self.proxy.port_for(self.server.port)}/0"

    def servers(self) -> list[EmbeddedRedis]:
        if self.cluster is not None:
            return self.cluster.nodes
        if self.sentinel is not None:
            return self.sentinel.servers
        assert self.server is not None
        return [self.server]

    def primaries(self) -> list[EmbeddedRedis]:
        if self.cluster is not None:
            return self.cluster.primaries_now()
        if self.sentinel is not None:
            return [self.sentinel.primary_now()]
        assert self.server is not None
        return [self.server]

    def cleanup(self) -> None:
        if self.aof is not None:
            self.aof.stop()
        if self.cluster is not None:
            self.cluster.cleanup()
        if self.sentinel is not None:
            self.sentinel.cleanup()
        if self.server is not None:
            self.server.cleanup()
        self.proxy.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    # --- the faults (blocking: run them in a thread) -----------------------------------

    def restart(self, down_s: float) -> None:
        """SIGTERM the one server (its AOF written whole), ``down_s`` away, start it."""
        assert self.server is not None
        self.server.stop()
        time.sleep(down_s)
        self.server.start()

    def crash(self, down_s: float) -> int:
        """The one server's host crashes: SIGKILL, its AOF cut to what its last fsync
        covered, ``down_s`` away, started from that. Returns the bytes lost."""
        assert self.server is not None and self.aof is not None
        self.server.kill()
        lost = self.aof.cut()
        time.sleep(down_s)
        self.server.start()
        return lost

    def wipe(self, down_s: float) -> None:
        """SIGKILL the one server and start it ``down_s`` later with nothing but the run's
        API keys (``provision``)."""
        assert self.server is not None and self.provisioned is not None
        self.server.kill(wipe=True)
        if self.server.persist:  # the AOF's base is the provisioned snapshot
            folder = self.server.data_dir / "appendonlydir"
            folder.mkdir()
            shutil.copy(self.provisioned, folder / "appendonly.aof.1.base.rdb")
            (folder / "appendonly.aof.1.incr.aof").touch()
            (folder / "appendonly.aof.manifest").write_text(
                "file appendonly.aof.1.base.rdb seq 1 type b\n"
                "file appendonly.aof.1.incr.aof seq 1 type i\n"
            )
        else:
            shutil.copy(self.provisioned, self.server.data_dir / "dump.rdb")
        time.sleep(down_s)
        self.server.start()

    def fail_over(self, pick: int, promoted: Callable[[str], None]) -> None:
        """SIGKILL a primary (the cluster's ``pick``-th, or Sentinel's); returns once its
        replica serves and the old one is back as a replica. ``promoted`` is called with
        the one it killed as soon as the replica serves: Redis answers again from then on,
        and has lost what the replica had not received, whether or not the old one comes
        back in time."""
        if self.cluster is not None:
            primaries = sorted(self.cluster.primaries_now(), key=lambda node: node.port)
            victim = primaries[pick % len(primaries)]
            self.cluster.kill_primary(victim, 90)
            promoted(f"redis:{victim.port}")
            victim.start()
            self.cluster.wait_healthy(90)
            return
        assert self.sentinel is not None
        victim = self.sentinel.primary_now()
        victim.kill()
        self.killed_at = time.monotonic()
        self.sentinel.wait_promoted(victim, 90)
        promoted(f"redis:{victim.port}")
        victim.start()  # the Sentinels make it a replica of the new primary
        self._wait_replica(victim, 90)

    def fail_over_in_s(self) -> float:
        """How long ``fail_over`` should wait: on Sentinel, until twice the Sentinels'
        ``failover-timeout`` after its last kill (sooner, they would by their own rule leave
        the new primary down until then)."""
        if self.sentinel is None:
            return 0.0
        spacing_s = 2 * self.sentinel.failover_timeout_ms / 1000
        return max(0.0, self.killed_at + spacing_s - time.monotonic())

    def _wait_replica(self, server: EmbeddedRedis, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with _client(server.port) as client:
                    info = client.info("replication")
                if info["role"] == "slave" and info.get("master_link_status") == "up":
                    return
            except redis.RedisError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"redis:{server.port} did not follow the new primary in {timeout_s} s")

    def pause(self, held_s: float) -> None:
        """``CLIENT PAUSE`` writes for ``held_s`` on every primary (returns at once)."""
        for node in self.primaries():
            with _client(node.port) as client:
                client.execute_command("CLIENT", "PAUSE", int(held_s * 1000), "WRITE")

    def fill(self, full: bool) -> None:
        """Every primary's ``maxmemory`` just above what it holds now (``full``: writes
        that need memory are refused, ``OOM``), or none again."""
        for node in self.primaries():
            with _client(node.port) as client:
                used = int(client.info("memory")["used_memory"]) if full else 0
                limit = used + FILL_MARGIN_BYTES if full else 0
                client.config_set("maxmemory", limit)

    def provision(self, keys: Keys) -> None:
        """Keep the run's API keys (their records and version) as an RDB file of their
        own, what a wiped Redis starts from."""
        with sync_client(self.url) as live:
            records = live.hgetall(keys.tenant_records)
            version = live.get(keys.tenant_version)
        (self.folder / "provision").mkdir()
        with EmbeddedRedis(data_dir=self.folder / "provision") as side:
            with _client(side.port) as client:
                if records:
                    client.hset(keys.tenant_records, mapping=records)
                if version is not None:
                    client.set(keys.tenant_version, version)
                client.save()
            shutil.copy(side.data_dir / "dump.rdb", self.folder / "provisioned.rdb")
        self.provisioned = self.folder / "provisioned.rdb"


def datastore(kind: str, logs: Path) -> Datastore:
    """A started Redis of ``kind`` behind a started proxy (``cleanup`` stops both)."""
    listen: dict[int, int] = {}

    def reach(port: int) -> int:
        return listen.setdefault(port, free_port())

    server = cluster = sentinel = None
    if kind in ("single", "volatile"):
        server = EmbeddedRedis(data_dir=logs / "redis", persist=kind == "single")
        server.data_dir.mkdir(parents=True, exist_ok=True)
        servers = [server]
    elif kind == "cluster":
        cluster = EmbeddedCluster(reach=reach)
        servers = cluster.nodes
    else:
        sentinel = EmbeddedSentinel(
            replicas=1,
            sentinels=3,
            reach=reach,
            persist=True,
            down_after_ms=SENTINEL_DOWN_AFTER_MS,
            failover_timeout_ms=SENTINEL_FAILOVER_TIMEOUT_MS,
        )
        servers = sentinel.servers
    for node in [*servers, *(sentinel.sentinels if sentinel is not None else [])]:
        node.extra_args += ["--logfile", str(logs / f"redis-{node.port}.log")]
    proxy = Proxy("redis", {node.port: reach(node.port) for node in servers}, logs)
    store = Datastore(kind, proxy, server, cluster, sentinel)
    try:
        proxy.start()
        if server is not None:
            server.start()
            if server.persist:
                store.aof = AofWatch(server.data_dir)
        elif cluster is not None:
            cluster.start()
        elif sentinel is not None:
            sentinel.start()
    except BaseException:
        store.cleanup()
        raise
    return store

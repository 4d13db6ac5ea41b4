"""What the cluster tests do to the test session's Redis Cluster (stack/redis_cluster.py):
kill the primary of a session, bring it back, move a slot to another primary; and, for
them and the Sentinel tests, the check of a reply read across such an event and the
reader's longest pause."""

from __future__ import annotations

import itertools
import socket
import time
from typing import Any

import wire
from stack.redis_cluster import EmbeddedCluster, _cmd
from stack.redis_server import EmbeddedRedis
from tests.support.http import TERMINAL
from tests.support.oracle import synthetic_text
from tests.support.redis_probes import event_key
from tests.support.sse import Event
from tests.support.tokens import assert_gap_free_tokens


def slot_of(cluster: EmbeddedCluster, key: str) -> int:
    with cluster.client(cluster.live()[0]) as client:
        return int(_cmd(client, "CLUSTER KEYSLOT", key))


def relay_connections(cluster: EmbeddedCluster, node: EmbeddedRedis, gateway_pid: int) -> int:
    """The live-event connections one gateway process holds on ``node``, counted by their
    client name (other gateways' never count) whether subscribed now or not: a connection
    whose streams all ended has no subscription left and is no longer of type pubsub."""
    name = wire.relay_name(socket.gethostname(), gateway_pid)
    with cluster.client(node) as client:
        return sum(c.get("name") == name for c in client.client_list())


def key_lookups(cluster: EmbeddedCluster) -> int:
    """``COMMAND GETKEYS`` calls the live nodes served so far: what redis-py's cluster client
    sends before a command whose keys it cannot find itself (XREAD, XREADGROUP)."""
    calls = 0
    for node in cluster.live():
        with cluster.client(node) as client:
            stats = client.info("commandstats").get("cmdstat_command|getkeys", {})
            calls += int(stats.get("calls", 0))
    return calls


def revive(cluster: EmbeddedCluster, node: EmbeddedRedis) -> None:
    """Start a killed node again: it rejoins (its nodes.conf kept) as a replica of the
    primary that replaced it; returns once the cluster is healthy."""
    node.start()
    cluster.wait_healthy()


def migrate_slot(cluster: EmbeddedCluster, slot: int, target: EmbeddedRedis) -> float:
    """Move ``slot`` with its keys to ``target`` (a primary), the way a reshard does: mark
    it importing and migrating, MIGRATE its keys in batches, then give it to ``target``
    on every node. Returns the seconds the move took."""
    began = time.monotonic()
    with cluster.client(cluster.live()[0]) as any_node:
        source_port = next(
            port
            for start, end, (_h, port, *_), *_r in _cmd(any_node, "CLUSTER SLOTS")
            if start <= slot <= end
        )
    source = next(node for node in cluster.nodes if node.port == source_port)
    with cluster.client(source) as src, cluster.client(target) as dst:
        source_id, target_id = _cmd(src, "CLUSTER MYID"), _cmd(dst, "CLUSTER MYID")
        _cmd(dst, "CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        _cmd(src, "CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        while keys := _cmd(src, "CLUSTER GETKEYSINSLOT", slot, 100):
            _cmd(src, "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        _cmd(dst, "CLUSTER SETSLOT", slot, "NODE", target_id)
        _cmd(src, "CLUSTER SETSLOT", slot, "NODE", target_id)
    for node in cluster.primaries_now():
        with cluster.client(node) as client:
            _cmd(client, "CLUSTER SETSLOT", slot, "NODE", target_id)
    cluster.wait_healthy()
    return time.monotonic() - began


def outage_s(arrived: list[float], since: float) -> float:
    """The longest wait between two events the reader got after ``since``."""
    times = [since, *(at for at in arrived if at >= since)]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def check_reply(events: list[Event], gid: str, content: str, max_tokens: int) -> dict[str, Any]:
    """What a reader got of one synthetic reply: ids strictly increasing (nothing
    repeated), then either the whole reply (every token once, in order, byte for byte,
    one ``done``) or, where Redis lost data, tokens without a gap or repeat up to one
    clear ``error`` final event. Returns the final event's data."""
    ids = [event_key(e.id or "") for e in events]
    assert ids == sorted(set(ids)), "events repeated or out of order"
    mine = [e for e in events if e.json().get("generation_id") == gid]
    finals = [e for e in mine if e.event in TERMINAL]
    assert len(finals) == 1 and mine[-1] is finals[0], [e.event for e in mine]
    tokens = [e.json() for e in mine if e.event == "token"]
    made = assert_gap_free_tokens(tokens)
    final: dict[str, Any] = finals[0].json()
    if finals[0].event == "error":
        assert final.get("message"), final
        return final
    assert finals[0].event == "done", final
    assert made == max_tokens == final["usage"]["completion_tokens"]
    assert "".join(token["text"] for token in tokens) == synthetic_text(content, max_tokens)
    return final

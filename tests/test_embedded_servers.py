"""The embedded servers the tests, benchmarks and `make run` start (stack/redis_server.py,
stack/redis_cluster.py): each gets a port of its own, and says so when it does not.

Found by a fresh clone's `make test`: a Redis Cluster of three nodes never formed ("every
node knows every other within 60 s"). Every node's port is picked before any node starts;
a port picked and released is free again, and the kernel offers it again (141 repeats in
2,000 picks on this machine), so two nodes could be given one port; the second could not
bind it, yet answered PING through the first, and was taken for started.
"""

from __future__ import annotations

import pytest

from stack.redis_server import EmbeddedRedis, free_port


def test_free_port_hands_out_no_port_twice() -> None:
    ports = [free_port() for _ in range(2_000)]
    assert len(set(ports)) == len(ports)


def test_a_cluster_nodes_port_and_bus_port_are_both_its_own() -> None:
    ports = [free_port(bus_offset=10_000) for _ in range(500)]
    everything = ports + [port + 10_000 for port in ports]
    assert len(set(everything)) == len(everything)
    assert max(everything) <= 65_535


def test_a_server_that_does_not_get_its_port_says_so() -> None:
    with EmbeddedRedis() as first:
        second = EmbeddedRedis(port=first.port)
        try:
            with pytest.raises(RuntimeError, match=r"served by another process|exited"):
                second.start()
            assert second.process is None or second.process.poll() is not None
        finally:
            second.stop()
            second.cleanup()

"""Idle keep-alive connections outlive common proxies' idle timeouts.

uvicorn closes an idle connection after 5 s by default; a client pool (the openai SDK, a
proxy) that reuses one at that moment loses its request (``httpx.ReadError``). The gateway
keeps them for ``TOKENSPOUT_KEEPALIVE_S`` (75 s) instead, longer than the 60 s that nginx
and most pools use, so the client side always closes first.
"""

from __future__ import annotations

import socket
import time

from tests.support.stack import Stack

REQUEST = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"


def _get_health(conn: socket.socket) -> bytes:
    conn.sendall(REQUEST)
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        reply += chunk
    return reply


def _closed_by_peer(conn: socket.socket, within_s: float) -> bool:
    conn.settimeout(within_s)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False


def test_an_idle_connection_is_kept_past_uvicorns_five_seconds(stack: Stack) -> None:
    gateway = stack.gateway()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as conn:
        assert _get_health(conn).startswith(b"HTTP/1.1 200")
        assert not _closed_by_peer(conn, within_s=7), "closed an idle keep-alive connection"
        conn.settimeout(10)
        assert _get_health(conn).startswith(b"HTTP/1.1 200")


def test_the_keep_alive_timeout_is_a_setting(stack: Stack) -> None:
    gateway = stack.gateway(TOKENSPOUT_KEEPALIVE_S="1")
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as conn:
        assert _get_health(conn).startswith(b"HTTP/1.1 200")
        began = time.monotonic()
        assert _closed_by_peer(conn, within_s=10)
        assert time.monotonic() - began < 5

"""Random ids and secrets, cut from a buffer of the OS's randomness.

``secrets.token_urlsafe`` asks the kernel for each id: a ``getrandom`` system call, three
for a one-shot request (its request id, its session's and its generation's), 5 % of the
gateway's CPU per request in a native profile (docs/bench.md). Here one call
fills a buffer that serves about a hundred ids. The bytes are the same ``os.urandom``
bytes, each used once; a forked child starts with an empty buffer, so parent and child
never hand out the same bytes.
"""

from __future__ import annotations

import base64
import os
import threading

POOL_BYTES = 4096


class RandomPool:
    """Bytes from ``os.urandom``, handed out once each."""

    def __init__(self, size: int = POOL_BYTES) -> None:
        self.size = size
        self.buffer = b""
        self.used = 0
        # The gateway takes ids on its event loop alone; the lock keeps two threads from
        # ever being handed the same bytes, should one take ids too.
        self.lock = threading.Lock()

    def take(self, n: int) -> bytes:
        with self.lock:
            end = self.used + n
            if end > len(self.buffer):
                self.buffer, self.used, end = os.urandom(max(self.size, n)), 0, n
            taken = self.buffer[self.used : end]
            self.used = end
            return taken

    def forget(self) -> None:
        """Drop what is left (in a forked child: its parent hands those out)."""
        with self.lock:
            self.buffer, self.used = b"", 0


_POOL = RandomPool()
os.register_at_fork(after_in_child=_POOL.forget)


def token_urlsafe(nbytes: int) -> str:
    """As ``secrets.token_urlsafe``: ``nbytes`` random bytes, URL-safe base64."""
    return base64.urlsafe_b64encode(_POOL.take(nbytes)).rstrip(b"=").decode("ascii")


def token_hex(nbytes: int) -> str:
    """As ``secrets.token_hex``: ``nbytes`` random bytes, in hex."""
    return _POOL.take(nbytes).hex()


def new_id(kind: str) -> str:
    """A session's (``s``), generation's (``g``) or other object's id: 128 random bits."""
    return f"{kind}_{token_urlsafe(16)}"

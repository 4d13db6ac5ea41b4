"""gateway/core/ids.py: ids and secrets cut from a buffer of the OS's randomness: the formats of
``secrets``, no bytes handed out twice, none shared with a forked child."""

from __future__ import annotations

import os
import re

from gateway.core import ids
from gateway.core.ids import RandomPool


def test_ids_have_the_formats_of_secrets() -> None:
    assert re.fullmatch(r"s_[A-Za-z0-9_-]{22}", ids.new_id("s"))
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", ids.token_urlsafe(32))
    assert re.fullmatch(r"[0-9a-f]{16}", ids.token_hex(8))


def test_no_bytes_are_handed_out_twice_across_refills() -> None:
    pool = RandomPool(size=64)
    taken = [pool.take(16) for _ in range(1000)]  # 250 refills
    assert len(set(taken)) == 1000
    assert len(pool.take(100)) == 100  # more than the buffer holds: a buffer of its own
    assert len({ids.new_id("g") for _ in range(20_000)}) == 20_000


def test_a_forked_child_hands_out_none_of_its_parents_bytes() -> None:
    ids.token_hex(8)  # the parent's buffer holds unused bytes now
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its next id, to the parent
        try:
            os.write(writing, ids.token_hex(16).encode())
        finally:
            os._exit(0)
    os.close(writing)
    childs = os.read(reading, 64).decode()
    os.close(reading)
    os.waitpid(child, 0)
    parents = ids.token_hex(16)
    assert re.fullmatch(r"[0-9a-f]{32}", childs)
    assert childs != parents  # without the reset both would take the same next 16 bytes

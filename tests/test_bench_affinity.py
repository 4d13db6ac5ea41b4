"""``python -m bench.affinity``, tiny: two synthetic workers a side with their prefix caches, the
three workloads a few seconds each on pull (no affinity), affinity and the oracle. The figures are
docs/bench/affinity.md's (full runs); this proves the bench runs, reads each worker's own
counts, and that they say what the workloads are: a shared system prompt is found in the
cache, prompts with nothing shared are prefilled whole, a conversation's history sometimes,
and always on the oracle, which sends each turn where its history is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import run_bench

pytestmark = pytest.mark.timeout(300)


def test_a_short_run_of_the_three_workloads_reads_each_workers_prefix_cache(
    tmp_path: Path,
) -> None:
    out = tmp_path / "affinity"
    run_bench(
        "bench.affinity",
        out,
        *("--workers", "2", "--rates", "3", "--seconds", "4", "--warmup-s", "2"),
        # Caches that never evict, and a holder waited for however starved the machine: a
        # turn whose history some worker holds is a hit and finds all of it.
        *("--kv-cache-tokens", "1000000", "--affinity-wait-ms", "10000"),
        timeout_s=200,
    )
    results = json.loads(out.with_suffix(".json").read_text())
    points = {(point["side"], point["workload"]): point for point in results["points"]}
    sides = ("affinity", "oracle", "pull")
    assert sorted(points) == [(side, w) for side in sides for w in ("a", "b", "c")]
    for point in points.values():
        assert point["workers"] == 2 and len(point["per_worker"]) == 2
        assert point["requests"] > 0 and point["failed"] == 0, point
        assert point["ttft_p50_ms"] > 0 and point["tokens_per_s"] > 0, point
    pull = {workload: points["pull", workload] for workload in "abc"}
    # A 2,000-token system prompt, each worker's cache holds it after its first request.
    assert pull["b"]["cache_hit_share"] > 0.7, pull["b"]
    # Nothing shared: every prompt (2,000 words and a question of 50 to 250) prefilled whole.
    assert pull["c"]["cache_hit_share"] == 0, pull["c"]
    assert 2_000 <= pull["c"]["prefilled_per_turn"] <= 2_250, pull["c"]
    # A turn finds its history where its previous turn ran: on one of two workers...
    assert 0.1 < pull["a"]["cache_hit_share"] < 0.95, pull["a"]
    # ...and always when sent to the worker whose cache holds it: over the whole point (the
    # conversations under way at its start have their first turn here cold on every side),
    # the oracle's turns find what their copies of the caches said, and each of affinity's
    # finds its whole history, as every worker's cache as one would give (the window's
    # share is the full run's figure, docs/bench/affinity.md: a 4 s window holds a turn or
    # two more or fewer by how fast the turns before them ran).
    whole = {side: points[side, "a"]["whole"] for side in sides}
    assert all(w["drained"] and w["findable_tokens"] > 0 for w in whole.values()), whole
    oracle = whole["oracle"]
    assert (
        abs(oracle["oracle_expected_cached"] - oracle["cached_tokens"])
        <= 0.1 * oracle["cached_tokens"]
    ), oracle
    assert whole["pull"]["cached_tokens"] <= oracle["cached_tokens"] <= oracle["findable_tokens"]
    assert whole["pull"]["cached_tokens"] < whole["pull"]["findable_tokens"], whole["pull"]
    # Affinity sends a turn where its history is, from the workers' own word of what they
    # hold; the workers count it (pull's never do).
    assert whole["affinity"]["affinity_misses"] == 0, whole["affinity"]
    assert whole["affinity"]["cached_tokens"] == whole["affinity"]["findable_tokens"], whole
    affine = points["affinity", "a"]
    assert affine["affinity_hits"] > 0 and pull["a"]["affinity_hits"] == 0, (affine, pull)
    # The hits' time queued, and each affinity worker's measured prefill (5,000 tokens/s at
    # most: the synthetic engine's rate).
    assert affine["affinity_wait_ms"]["hit"] is not None, affine
    assert pull["a"]["affinity_wait_ms"] == {"hit": None, "miss": None}, pull["a"]
    rates = [worker["prefill_tokens_per_s"] for worker in affine["per_worker"]]
    assert all(0 < rate <= 5_000 for rate in rates), rates
    report = out.with_suffix(".md").read_text()
    assert "| b: a shared system prompt | 2 | pull |" in report
    assert "| a | 2 | oracle | 3.00 |" in report  # against pull, at the same load
    assert out.with_suffix(".png").stat().st_size > 0

"""``python -m bench.fairness``, short: four tenants on one synthetic engine, the fair
gateway against the first-come one, and three weighted keys. The figures themselves are
docs/bench/fairness.md's (a full run); this proves the bench works and that the scheduler
does what the figures show: a quiet key no longer waits behind a noisy one's backlog, the
engine serves as many tokens, and the weighted keys' shares come in their order."""

from __future__ import annotations

import pytest

from bench import fairness

pytestmark = pytest.mark.timeout(300)


async def test_a_short_fairness_run_shows_the_quiet_keys_first_and_the_weights_in_order() -> None:
    options = fairness.Options(seconds=5, warmup_s=2, out=None)
    results = await fairness.run(options)
    points = {point["name"]: point for point in results["points"]}
    for point in points.values():
        assert all(key["requests"] and not key["failed"] for key in point["keys"].values())
    fifo, fair = points["noisy, fifo"]["keys"], points["noisy, fair"]["keys"]
    for name in fairness.QUIET:
        # Behind the noisy key's backlog first come, first served; ahead of it by counters.
        assert fair[name]["ttft_p50_ms"] * 2 < fifo[name]["ttft_p50_ms"], (fair, fifo)
        assert fair[name]["tokens_per_s"] >= 0.8 * fair[name]["fair_share_tokens_per_s"]
    assert points["noisy, fair"]["tokens_per_s"] >= 0.9 * points["noisy, fifo"]["tokens_per_s"]
    shares = [points["weights 1:2:4"]["keys"][name]["share"] for name in fairness.WEIGHTED]
    assert shares == sorted(shares), shares
    for share, weight in zip(shares, fairness.WEIGHTED.values(), strict=True):
        assert share == pytest.approx(weight / 7, rel=0.25), shares
    assert fairness.markdown(results).count("| weights 1:2:4 |") == 4

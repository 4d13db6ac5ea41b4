"""The chaos run's usage check (bench/chaos/usage.py) names each way a key's counted
tokens can differ from what its clients received: a clean run passes, and each
difference is an anomaly naming the generation. Without this, a chaos run whose usage
check found nothing would prove nothing."""

from __future__ import annotations

from typing import Any

from bench.chaos.clients import Record, rate_limited
from bench.chaos.tenants import ApiKey
from bench.chaos.usage import Generation, TenantSets, UsageCheck

PLAIN = ApiKey("chaos-w1", "k_00000000000000a1", "tsk_a", 1.0)
LIMITED = ApiKey("chaos-limited", "k_00000000000000b2", "tsk_b", 1.0, {"concurrent": 3})


def generation(
    gid: str, *, tokens: int = 5, prompt: int | None = 3, key: ApiKey = PLAIN, **final: Any
) -> Generation:
    """A generation that started with ``prompt`` tokens, delivered ``tokens`` and ended
    ``done`` billing them (``final`` changes its final event)."""
    ended = {"type": "done", "usage": {"prompt_tokens": prompt or 0, "completion_tokens": tokens}}
    ended.update(final)
    return Generation(
        f"s_{gid}",
        gid,
        key.id,
        final=ended,
        prompt=prompt,
        tokens=tokens,
        count=tokens,
        finals=[str(ended["type"])],
        final_ms=1_000_500,
    )


def record(gid: str, told: tuple[int, int] | None, **changes: Any) -> Record:
    """A client's reply that saw its end and was told ``told`` (prompt, completion)."""
    reply = Record("sse", f"c0.{gid}", "alpha", "c0 tide", 10, 1.0, PLAIN, generation_id=gid)
    reply.final = "done"
    if told is not None:
        reply.usage_told = {"prompt_tokens": told[0], "completion_tokens": told[1]}
    for name, value in changes.items():
        setattr(reply, name, value)
    return reply


def run(
    generations: list[Generation],
    records: list[Record],
    counted: list[tuple[ApiKey, dict[str, int]]],
    *,
    cluster: bool = False,
    sets: TenantSets | None = None,
    failovers: tuple[float, ...] = (),
) -> tuple[UsageCheck, list[dict[str, Any]]]:
    """The check over ``generations`` and ``records``, with what Redis ``counted`` per key
    (``sets``: every key's counted and running generations)."""
    keys = [key for key, _ in counted]
    check = UsageCheck(
        keys, {g.generation_id: g for g in generations}, records, 1_000_000, cluster, [*failovers]
    )
    check.check_generations()
    seen = check.check_records()
    figures = [
        check.check_key(key, total, sets or TenantSets(set(), []), seen, 60.0)
        for key, total in counted
    ]
    return check, figures


def tally(prompt: int, completion: int, generations: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "generations": generations}


def findings(check: UsageCheck) -> list[str]:
    return [finding.what for finding in check.findings]


def test_a_key_counted_what_its_clients_received_passes() -> None:
    """Done, cancelled after 2 tokens, a second choice (no prompt), a queued cancel
    (nothing), an error whose usage its takeover recorded: counted as delivered."""
    generations = [
        generation("g1"),
        generation("g2", tokens=2, type="cancelled", reason="user"),
        generation("g3", bill="completion"),
        generation("g4", tokens=0, prompt=None, type="cancelled", reason="user"),
        generation("g5", tokens=4, type="error", code="events_lost", usage=None),
    ]
    generations[2].bill = "completion"
    generations[4].recorded = {"prompt_tokens": 3, "completion_tokens": 4}
    check, figures = run(
        generations,
        [record("g1", (3, 5)), record("g2", (3, 2))],
        [(PLAIN, tally(3 + 3 + 0 + 0 + 3, 5 + 2 + 5 + 0 + 4, 5))],
    )
    assert findings(check) == []
    assert figures[0]["delivered"] == figures[0]["counted"]
    assert figures[0]["other_choices"] == 1
    assert figures[0]["ended_unseen_by_clients"] == 2  # g4, g5; g3 is a second choice


def test_a_generation_billed_other_than_it_delivered_is_named() -> None:
    billed_one_more = generation("g1", usage={"prompt_tokens": 3, "completion_tokens": 6})
    check, _ = run([billed_one_more], [], [(PLAIN, tally(3, 6, 1))])
    assert findings(check) == [
        "billed differs from delivered: g1 (session s_g1, done): delivered 3+5, its final "
        "billed 3+6",
        "counted {'prompt_tokens': 3, 'completion_tokens': 6, 'generations': 1}, delivered "
        "{'prompt_tokens': 3, 'completion_tokens': 5, 'generations': 1}",
    ]


def test_a_key_counted_short_names_what_a_cluster_never_counted() -> None:
    """With the failover that may have lost its count, if one was near its end."""
    generations = [generation("g1"), generation("g2")]
    counted = TenantSets({"g1"}, [])
    for failovers, why in [
        ((0.0, 9.0), "a primary killed -0.5 s from its end"),
        ((), "no failover near"),
    ]:
        check, _ = run(
            generations,
            [],
            [(PLAIN, tally(3, 5, 1))],
            cluster=True,
            sets=counted,
            failovers=failovers,
        )
        whats = findings(check)
        assert any(what.startswith("counted {") for what in whats)
        assert [w for w in whats if "never counted on the cluster" in w] == [
            f"ended, never counted on the cluster ({why}): g2 (session s_g2, done): delivered "
            "3+5, its final billed 3+5"
        ]


def test_a_reply_that_reported_other_usage_than_delivered_is_named() -> None:
    """A request with two choices reports its prompt once and both completions."""
    generations = [generation("g1"), generation("g2")]
    clean = record("g1", (3, 10), kind="openai_whole", choices=2)
    wrong = record("g2", (3, 9), kind="openai_whole", choices=2)
    check, _ = run(generations, [clean, wrong], [(PLAIN, tally(6, 10, 2))])
    assert [f.label for f in check.findings] == ["c0.g2"]
    assert "reported 3+9 tokens for 2 choices; the first delivered 3+5" in findings(check)[0]


def test_a_generation_billing_another_key_than_its_clients_is_named() -> None:
    theirs = generation("g1", key=LIMITED)
    check, _ = run(
        [theirs], [record("g1", (3, 5))], [(PLAIN, tally(0, 0, 0)), (LIMITED, tally(3, 5, 1))]
    )
    assert findings(check) == [f"g1 bills {LIMITED.id}; its client sent with chaos-w1 ({PLAIN.id})"]


def test_a_generation_that_never_ended_but_delivered_tokens_is_named() -> None:
    running = generation("g1", tokens=2)
    running.final, running.finals = None, []
    never_started = generation("g2", tokens=0, prompt=None)
    never_started.final, never_started.finals = None, []
    check, figures = run([running, never_started], [], [(PLAIN, tally(0, 0, 0))])
    assert [f.label for f in check.findings] == ["usage g1"]
    assert figures[0]["delivered"] == tally(0, 0, 0)


def test_numbering_a_second_final_and_a_key_nobody_made_are_named() -> None:
    miscounted = generation("g1")
    miscounted.count = 6
    twice = generation("g2")
    twice.finals = ["done", "cancelled"]
    stranger = generation("g3")
    stranger.tenant = "anonymous"
    check, _ = run([miscounted, twice, stranger], [], [(PLAIN, tally(6, 10, 2))])
    assert findings(check) == [
        "5 tokens delivered, numbered 6",
        "its stream holds the finals ['done', 'cancelled']",
        "bills anonymous, no key of the run",
    ]


def test_a_limited_key_left_counting_generations_is_named() -> None:
    _, figures = run([], [], [(LIMITED, tally(0, 0, 0))], sets=TenantSets(set(), []))
    assert figures[0]["limits"] == {"concurrent": 3}
    check, _ = run(
        [generation("g8", key=LIMITED)],
        [],
        [(LIMITED, tally(3, 5, 1))],
        sets=TenantSets(set(), ["g8", "g9"]),
    )
    assert findings(check) == [
        "2 generations still count against its limits: g8 (done), g9 (admitted, never "
        "submitted: no such generation)"
    ]


def test_a_refusal_by_limits_is_expected_of_a_limited_key_only() -> None:
    limited = record("g1", None, key=LIMITED)
    rate_limited(limited, "429")
    assert limited.rate_limited == 1 and limited.problems == []
    plain = record("g2", None)
    rate_limited(plain, "429")
    assert plain.problems == ["refused by the limits of chaos-w1, which has none: 429"]

"""engine/worker.py ``PrepareTurns``: requests prepare in the order they asked, about
``PREPARE_TURN_S`` of prepare CPU per turn of the event loop (tests/test_engine_burst.py
has a burst of slow prepares on a real worker and Redis)."""

from __future__ import annotations

import asyncio

from engine.worker import PREPARE_TURN_S, PrepareTurns


async def turns_given(turns: PrepareTurns, requests: int) -> list[tuple[int, int]]:
    """(request, the turn of the loop its prepare was given in), in the order given, for
    ``requests`` requests that ask at once (each prepare takes the measured mean)."""
    turn, given = 0, []

    async def count_turns() -> None:
        nonlocal turn
        while True:
            await asyncio.sleep(0)
            turn += 1

    async def request(index: int) -> None:
        await turns.take()
        given.append((index, turn))
        turns.prepared(turns.mean_s)

    counting = asyncio.create_task(count_turns())
    try:
        await asyncio.gather(*(request(index) for index in range(requests)))
    finally:
        counting.cancel()
    return given


async def test_cheap_prepares_go_many_to_a_turn() -> None:
    turns = PrepareTurns()
    turns.prepared(PREPARE_TURN_S / 20)
    given = await turns_given(turns, 50)
    assert [index for index, _ in given] == list(range(50))
    per_turn = [sum(1 for _, turn in given if turn == t) for t in sorted({t for _, t in given})]
    assert per_turn == [20, 20, 10]


async def test_slow_prepares_go_one_to_a_turn_in_the_order_they_asked() -> None:
    turns = PrepareTurns()
    turns.prepared(PREPARE_TURN_S * 5)
    given = await turns_given(turns, 5)
    assert [index for index, _ in given] == list(range(5))
    assert len({turn for _, turn in given}) == 5


async def test_before_any_prepare_is_measured_one_goes_to_a_turn() -> None:
    given = await turns_given(PrepareTurns(), 3)
    assert len({turn for _, turn in given}) == 3


async def test_a_cancelled_waiter_gives_its_turn_to_the_next() -> None:
    turns = PrepareTurns()
    turns.prepared(PREPARE_TURN_S * 5)
    first, second, third = (asyncio.create_task(turns.take()) for _ in range(3))
    await asyncio.sleep(0)  # the first prepares in this turn, the others wait
    assert first.done() and not second.done() and not third.done()
    second.cancel()
    async with asyncio.timeout(1):
        await third
    assert second.cancelled()

"""A request's prefix names (wire/prefixes.py): two requests share a name exactly while they
share every message (or block of text) up to it; the next turn's name at the reply is the one
the worker that made the reply gives; a long request's lookup keeps a few names."""

from __future__ import annotations

from wire import ChatMessage
from wire.messages import Tools, ToolSpec
from wire.prefixes import (
    TEXT_BLOCK,
    Prefix,
    continued,
    message_prefixes,
    opening,
    spread,
    text_prefixes,
)

SYSTEM = ChatMessage("system", "You answer questions about the log. " * 50)


def test_requests_share_names_exactly_while_they_share_messages() -> None:
    start = opening("m")
    one = message_prefixes(start, [SYSTEM, ChatMessage("user", "first question")])
    two = message_prefixes(start, [SYSTEM, ChatMessage("user", "another question")])
    assert one[0] == two[0] and one[0].chars == len(SYSTEM.content)
    assert one[1].name != two[1].name
    # The same text in another role, or after another beginning, is another prefix.
    assert message_prefixes(start, [ChatMessage("user", SYSTEM.content)])[0] != one[0]
    assert message_prefixes(opening("other"), [SYSTEM])[0] != one[0]
    tools = Tools([ToolSpec("lookup")])
    assert message_prefixes(opening("m", tools), [SYSTEM])[0] != one[0]


def test_the_next_turn_is_named_at_the_reply_as_the_worker_names_it() -> None:
    start = opening("m")
    history = [SYSTEM, ChatMessage("user", "What does entry 4 say?")]
    prompt = message_prefixes(start, history)
    reply = "It says the level read 12."
    after_reply = continued(prompt[-1], reply)
    next_turn = [*history, ChatMessage("assistant", reply), ChatMessage("user", "And then?")]
    names = message_prefixes(start, next_turn)
    assert names[2] == after_reply
    assert names[:2] == prompt


def test_text_prompts_share_names_up_to_the_block_where_they_part() -> None:
    start = opening("m")
    common = "x" * (2 * TEXT_BLOCK + 100)
    one = text_prefixes(start, common + "a" * TEXT_BLOCK)
    two = text_prefixes(start, common + "b" * TEXT_BLOCK)
    assert [p.chars for p in one] == [TEXT_BLOCK, 2 * TEXT_BLOCK, 3 * TEXT_BLOCK]
    assert one[:2] == two[:2] and one[2] != two[2]
    assert text_prefixes(start, "short") == []


def test_a_long_requests_lookup_keeps_the_longest_names_and_the_first() -> None:
    prefixes = [Prefix(str(n), n) for n in range(40)]
    kept = spread(prefixes, most=8)
    assert [int(p.name) for p in kept] == [39, 38, 37, 36, 34, 30, 22, 0]
    assert spread(prefixes[:3]) == [prefixes[2], prefixes[1], prefixes[0]]

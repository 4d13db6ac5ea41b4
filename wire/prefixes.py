"""The names of a request's prefixes, as the gateway can give them without a tokenizer, and as
the worker that ran the request gives the prefix its reply makes (docs/affinity.md).

A chat request's prompt is its messages as the chat template writes them, one after another:
two prompts share their tokens up to where their messages part (and a few template tokens
past it). So a prefix is named at each message's end by a chain of hashes, each over the
name before it and the message: ``n_0`` names the model and the tools (which the template
writes first), ``n_k = H(n_(k-1), message k)``. Turn *N+1* of a conversation holds turn *N*'s
messages and its reply; its name at that reply is ``continued(n_m, reply)``, which the
worker that made the reply can give. A shared system prompt is every request's ``n_1``.

A prompt of text (completions) is named the same way over blocks of ``TEXT_BLOCK`` characters
from its start, so two prompts share names up to the block where they part.

Each name comes with the prefix's size in characters (about four a token: no tokenizer);
``spread`` keeps a few of a long request's names for a lookup: the longest ones, then every
other one back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from wire.messages import ChatMessage, GenerationRequest, Tools

TEXT_BLOCK = 1024
"""Characters of a text prompt each name adds."""
CHARS_PER_TOKEN = 4
"""About how many characters a token holds (English text, SmolLM2's and Llama's tokenizers):
a prefix's tokens guessed without a tokenizer."""
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Prefix:
    """A prefix of a prompt: its name, and its size in characters."""

    name: str
    chars: int

    @property
    def tokens(self) -> int:
        """About how many tokens the prefix is (``CHARS_PER_TOKEN``)."""
        return self.chars // CHARS_PER_TOKEN


def _chain(parent: str, part: bytes) -> str:
    return hashlib.blake2b(part, digest_size=8, key=bytes.fromhex(parent)).hexdigest()


def opening(model: str, tools: Tools | None = None) -> str:
    """``n_0``: what a prompt begins with before its first message."""
    head = _encode([model, tools.specs if tools is not None else None])
    return hashlib.blake2b(head, digest_size=8).hexdigest()


def message_prefixes(opening_name: str, messages: Sequence[ChatMessage]) -> list[Prefix]:
    """The name at the end of each message, first to last."""
    prefixes, name, chars = [], opening_name, 0
    for message in messages:
        name = _chain(name, _encode(message))
        chars += len(message.content)
        prefixes.append(Prefix(name, chars))
    return prefixes


def continued(prefix: Prefix, reply: str) -> Prefix:
    """The name of ``prefix`` followed by the assistant's ``reply``: the next turn's prompt
    begins with it."""
    name = _chain(prefix.name, _encode(ChatMessage("assistant", reply)))
    return Prefix(name, prefix.chars + len(reply))


def text_prefixes(opening_name: str, prompt: str) -> list[Prefix]:
    """The name at the end of each whole block of ``TEXT_BLOCK`` characters."""
    prefixes, name = [], opening_name
    for end in range(TEXT_BLOCK, len(prompt) + 1, TEXT_BLOCK):
        name = _chain(name, prompt[end - TEXT_BLOCK : end].encode())
        prefixes.append(Prefix(name, end))
    return prefixes


def spread(prefixes: Sequence[Prefix], most: int = 8) -> list[Prefix]:
    """At most ``most`` of ``prefixes``, longest first: the last few, then every other one
    back, and the first (a shared system prompt's) always."""
    if len(prefixes) <= most:
        return list(reversed(prefixes))
    kept: list[Prefix] = []
    at, step = len(prefixes) - 1, 1
    while at > 0 and len(kept) < most - 1:
        kept.append(prefixes[at])
        if len(kept) >= most // 2:
            step *= 2
        at -= step
    return [*kept, prefixes[0]]


def prompt_prefixes(model: str, request: GenerationRequest) -> list[Prefix]:
    """Every named prefix of ``request``'s prompt, first to last (none for a task that
    prefills nothing)."""
    if request.task != "generate":
        return []
    start = opening(model, request.tools)
    if request.prompt is not None:
        return text_prefixes(start, request.prompt)
    return message_prefixes(start, request.messages)


def asked(model: str, request: GenerationRequest) -> list[Prefix]:
    """The prefixes a queued request is placed by: ``spread``'s, longest first."""
    return spread(prompt_prefixes(model, request))


HELD_MOST = 64
"""The most names a worker says it holds for one request: a prompt's last ones and its first."""


def held(model: str, request: GenerationRequest, reply: str) -> list[str]:
    """The names of what running ``request`` with ``reply`` left in its engine's cache: its
    prompt's, and the next turn's prefix that ends with the reply (a chat's new assistant
    message; a text prompt's blocks that the reply completes)."""
    prefixes = prompt_prefixes(model, request)
    if not prefixes and request.task != "generate":
        return []
    if request.prompt is not None:
        prefixes = text_prefixes(opening(model, request.tools), request.prompt + reply)
    elif request.messages and not request.continue_final_message:
        prefixes.append(continued(prefixes[-1], reply))
    if len(prefixes) > HELD_MOST:
        prefixes = [prefixes[0], *prefixes[1 - HELD_MOST :]]
    return [prefix.name for prefix in prefixes]

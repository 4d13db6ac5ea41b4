"""The three workloads of ``python -m bench.affinity``, as clients of the gateway's OpenAI chat
API (streamed, the whole conversation in each request, as OpenAI's clients send it).

- ``a`` chats: conversations of 8 to 16 turns, each turn a user message of 300 to 570 words
  and a reply of ``reply_tokens``, a think time between turns (exponential); a history grows
  about 500 tokens a turn, to about 8,000. Conversations begin at the rate that makes
  ``rate`` turns a second, and a point starts with its population already under way (each
  conversation at a random turn, its history made up), so it is steady from its start.
- ``b`` shared: single requests, a 2,000-word system prompt every one shares and a question of
  50 to 250 words of its own, ``rate`` a second (Poisson).
- ``c`` unique: the same sizes with nothing shared.

The synthetic engine counts a word as a token and answers with a script
(engine/backends/synthetic.py), so a client knows each reply without reading its text and
the next turn's history is exactly what the engine made.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bench.loadgen import OpenAIStream, StreamRecord, http_request, open_stream
from engine.backends.prefill import Prefill
from engine.backends.synthetic import prompt_token_ids, scripted_reply
from stack.rig import HOST

WORKLOADS = ("a", "b", "c")
VOCABULARY = 50_000
"""Words are drawn from ``w0`` ... ``w49999``: two prompts share a block of 16 only by
sharing what came before it."""


@dataclass(frozen=True)
class Shape:
    """The workloads' sizes (words are tokens to the synthetic engine)."""

    reply_tokens: int = 64
    turns: tuple[int, int] = (8, 16)
    user_words: tuple[int, int] = (300, 570)
    think_s: float = 1.0
    system_words: int = 2_000
    question_words: tuple[int, int] = (50, 250)

    @property
    def mean_turns(self) -> float:
        return sum(self.turns) / 2


@dataclass
class Sent:
    """One request the load sent: its stream's record, its prompt's size, and which turn of
    which conversation it was (single requests: turn 1 of their own)."""

    record: StreamRecord
    prompt_words: int
    conversation: int
    turn: int


Send = Callable[[list[dict[str, str]], Sent], Awaitable[None]]
"""Sends one request's messages, recording into ``Sent``, and returns when its stream ends."""


def chat_sender(port: int, model: str, reply_tokens: int) -> Send:
    """Each request a streamed chat completion of ``model`` on the gateway at ``port``."""

    async def send(messages: list[dict[str, str]], sent: Sent) -> None:
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": reply_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Accept": "text/event-stream"}
        path = "/v1/chat/completions"
        request = http_request("POST", HOST, port, path, headers, json.dumps(body).encode())
        stream = await open_stream(HOST, port, request, sent.record, OpenAIStream)
        try:
            assert sent.record.finished is not None
            await sent.record.finished
        finally:
            stream.close()

    return send


def words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(VOCABULARY)}" for _ in range(count))


def reply_to(message: str, tokens: int) -> str:
    """The synthetic engine's reply to ``message``: what the next turn's history holds."""
    return "".join(token.text for token in scripted_reply(message, tokens))


def ended_ids(prompt: list[int], messages: list[dict[str, str]], tokens: int) -> list[int]:
    """What a synthetic engine's cache holds of a request once its reply of ``tokens``
    ended: the prompt's tokens (``prompt``, of ``messages``), then its reply's."""
    return [*prompt, *(token.id for token in scripted_reply(messages[-1]["content"], tokens))]


@dataclass
class Load:
    """One point's clients: what they sent, sent until ``until`` (perf_counter)."""

    send: Send
    shape: Shape
    rate: float
    until: float
    seed: int
    decode_tokens_per_s: float = 50.0
    everywhere: Prefill | None = None
    """Every worker's prefix cache as one: what a request would find were it sent to the
    worker that holds the most of it (exactly that while no worker's cache evicts)."""
    findable: int = 0
    """The prompt tokens of the requests sent that ``everywhere`` held when each was sent."""
    sent: list[Sent] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _conversations: int = 0

    async def run(self, workload: str) -> None:
        """Send ``workload`` until ``until``, then wait for what is under way. The same
        seed makes the same requests at the same times (each conversation draws from a
        generator of its own), so two sides of one point meet the same load."""
        arrivals = random.Random(f"{workload}-{self.seed}")
        system = words(random.Random(f"system-{self.seed}"), self.shape.system_words)
        if workload == "a":
            population = round(self.rate * (self.shape.think_s + self.turn_s()))
            for _ in range(population):  # the conversations under way when the point starts
                self._start(self._conversation(*self._next(workload), started=False))
            per_s = self.rate / self.shape.mean_turns
        else:
            per_s = self.rate
        while time.perf_counter() < self.until:
            await asyncio.sleep(arrivals.expovariate(per_s))
            if workload == "a":
                self._start(self._conversation(*self._next(workload), started=True))
            else:
                self._start(
                    self._single(*self._next(workload), system if workload == "b" else None)
                )
        while self._tasks:
            await asyncio.gather(*list(self._tasks))

    def _next(self, workload: str) -> tuple[int, random.Random]:
        """The next conversation's (or single request's) number and own random numbers."""
        self._conversations += 1
        number = self._conversations
        return number, random.Random(f"{workload}-{self.seed}-{number}")

    def turn_s(self) -> float:
        """About how long a turn of a conversation lasts, its think time not counted: its
        reply, at the engine's pace."""
        return self.shape.reply_tokens / self.decode_tokens_per_s

    def _start(self, client: Awaitable[None]) -> None:
        task = asyncio.ensure_future(client)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _conversation(self, number: int, rng: random.Random, *, started: bool) -> None:
        """One chat, from its first turn (``started``) or from a random one, its history
        made up, after a random part of a think time (the population already under way)."""
        shape = self.shape
        turns = rng.randint(*shape.turns)
        first = 1 if started else rng.randint(1, turns)
        history: list[dict[str, str]] = []
        for _ in range(first - 1):
            self._add_turn(history, words(rng, rng.randint(*shape.user_words)))
        if not started:
            await asyncio.sleep(rng.uniform(0, shape.think_s + self.turn_s()))
        for turn in range(first, turns + 1):
            if turn > first:
                await asyncio.sleep(rng.expovariate(1 / shape.think_s))
            if time.perf_counter() >= self.until:
                return
            message = words(rng, rng.randint(*shape.user_words))
            sent = await self._request([*history, {"role": "user", "content": message}], number)
            sent.turn = turn
            if sent.record.failure is not None:
                return
            self._add_turn(history, message)

    def _add_turn(self, history: list[dict[str, str]], message: str) -> None:
        history.append({"role": "user", "content": message})
        history.append({"role": "assistant", "content": reply_to(message, self.shape.reply_tokens)})

    async def _single(self, number: int, rng: random.Random, system: str | None) -> None:
        """One request: the shared system prompt (``system``) or as many words of its own,
        and a question."""
        opening = system if system is not None else words(rng, self.shape.system_words)
        question = words(rng, rng.randint(*self.shape.question_words))
        messages = [{"role": "system", "content": opening}, {"role": "user", "content": question}]
        await self._request(messages, number)

    async def _request(self, messages: list[dict[str, str]], conversation: int) -> Sent:
        prompt = prompt_token_ids(m["content"] for m in messages)
        sent = Sent(StreamRecord(), len(prompt), conversation, 1)
        self.sent.append(sent)
        if self.everywhere is not None:
            self.findable += self.everywhere.admit(prompt, 0.0).cached_tokens
        await self.send(messages, sent)
        if self.everywhere is not None and sent.record.final == "done":
            self.everywhere.ended(ended_ids(prompt, messages, self.shape.reply_tokens))
        return sent

"""bench.affinity's ``oracle`` side: every request pushed to the warmest worker, as the best push
router would send it, knowing each worker's prefix cache and prefill queue exactly.

Each of the side's workers serves a model of its own (``synthetic-1`` ... ``synthetic-W``), so
the client chooses the worker by the model it names. The synthetic engine is deterministic
(engine/backends/prefill.py: the same blocks in the same order, one prefill after another at
a known rate), so the client keeps a copy of each worker's: a request's prompt is taken by
the copy when it is sent (the worker takes it at once while it has free slots), its prompt
and reply when it ends. Warmest means the soonest first token: the worker whose cache holds
most of the prompt, unless the prefills queued there would outlast what the cache saves;
between equals, the one running fewest of the side's requests. (Warmest by the cache alone
sends every request that shares a prompt to the one worker that held it first, which then
serves them all while the others idle: the flood affinity must not make.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bench.affinity_load import Send, Sent, chat_sender, ended_ids
from engine.backends.prefill import Prefill
from engine.backends.synthetic import prompt_token_ids


def oracle_models(model: str, workers: int) -> list[str]:
    return [f"{model}-{n}" for n in range(1, workers + 1)]


@dataclass
class Worker:
    model: str
    send: Send
    cache: Prefill
    running: int = 0


class Warmest:
    def __init__(
        self, port: int, models: list[str], reply_tokens: int, prefill: tuple[float, int]
    ) -> None:
        """``prefill``: each worker's prefill tokens a second and KV cache tokens."""
        self.reply_tokens = reply_tokens
        self.workers = [
            Worker(model, chat_sender(port, model, reply_tokens), Prefill(*prefill))
            for model in models
        ]
        self.expected = 0
        """Prompt tokens the copies said a chosen worker's cache held: the side's engines'
        own count says how well the copies kept up."""

    def choose(self, prompt: list[int], now: float) -> Worker:
        """The worker where ``prompt``'s first token would come soonest."""
        names = self.workers[0].cache.cache.names(prompt)

        def wait(worker: Worker) -> tuple[float, int]:
            return worker.cache.look(len(prompt), names, now).ready_at, worker.running

        return min(self.workers, key=wait)

    async def send(self, messages: list[dict[str, str]], sent: Sent) -> None:
        prompt = prompt_token_ids(m["content"] for m in messages)
        now = time.monotonic()  # the copies' prefill lanes run on the client's clock
        worker = self.choose(prompt, now)
        self.expected += worker.cache.admit(prompt, now).cached_tokens
        worker.running += 1
        try:
            await worker.send(messages, sent)
        finally:
            worker.running -= 1
        if sent.record.final == "done":
            worker.cache.ended(ended_ids(prompt, messages, self.reply_tokens))

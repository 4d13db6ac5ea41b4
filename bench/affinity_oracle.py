"""bench.affinity's ``oracle`` side: every request sent to the warmest worker, as the best push
router would send it, knowing each worker's prefix cache exactly.

Each of the side's workers serves a model of its own (``synthetic-1`` ... ``synthetic-W``), so
the client chooses the worker by the model it names. The synthetic engine's cache is
deterministic (engine/backends/prefill.py: the same blocks in the same order), so the client
keeps a copy of each worker's: a request's prompt is looked up and stored when it is sent (the
worker takes it at once while it has free slots), its prompt and reply when it ends. The
warmest worker is the one whose cache holds most of the prompt; between equals, the one
running fewest of the side's requests. It waits for nobody and spreads nothing on purpose:
what it costs to always follow the cache is part of its figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.affinity_load import Send, Sent, chat_sender
from engine.backends.prefill import Prefill
from engine.backends.synthetic import prompt_token_ids, scripted_reply


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
        self, port: int, models: list[str], reply_tokens: int, kv_cache_tokens: int
    ) -> None:
        self.reply_tokens = reply_tokens
        self.workers = [
            Worker(model, chat_sender(port, model, reply_tokens), Prefill(0, kv_cache_tokens))
            for model in models
        ]
        self.expected = 0
        """Prompt tokens the copies said a chosen worker's cache held: the side's engines'
        own count says how well the copies kept up."""

    def choose(self, prompt: list[int]) -> Worker:
        def warmth(worker: Worker) -> tuple[int, int]:
            cache = worker.cache.cache
            return cache.cached_tokens(len(prompt), cache.names(prompt)), -worker.running

        return max(self.workers, key=warmth)

    async def send(self, messages: list[dict[str, str]], sent: Sent) -> None:
        prompt = prompt_token_ids(m["content"] for m in messages)
        worker = self.choose(prompt)
        self.expected += worker.cache.admit(prompt, 0.0).cached_tokens
        worker.running += 1
        try:
            await worker.send(messages, sent)
        finally:
            worker.running -= 1
        if sent.record.final == "done":
            reply = [t.id for t in scripted_reply(messages[-1]["content"], self.reply_tokens)]
            worker.cache.ended([*prompt, *reply])

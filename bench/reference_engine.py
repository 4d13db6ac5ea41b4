"""The engine alone: a backend's tokens streamed straight to the client, no gateway, no Redis.

``python -m bench.reference_engine --port P [engine flags]`` serves one endpoint,
``POST /v1/chat/completions`` with ``stream: true``, as OpenAI-format SSE chunks
(``data: {...chat.completion.chunk...}`` per token, a final chunk with the finish reason,
the usage chunk when ``stream_options.include_usage`` asks for it, then ``data: [DONE]``),
and ``GET /health``. Its backend is the engine worker's own, built from the same flags by
the worker's own code (``python -m engine``'s ``--backend``, ``--tokens-per-s``, ``--model``,
``--capacity``...): the synthetic engine by default, so for the same message and
``max_tokens`` this server and the gateway stream the same text on the same schedule
(``--tokens-per-s 0``: as fast as it can); ``--backend vllm`` runs vLLM in this process.

It is a bare ASGI app under uvicorn with the gateway's own server settings (uvloop,
httptools, no access log): what is left of the gateway's cost per token after subtracting
this server is the gateway, the engine worker's publishing and Redis. bench/e2e.py runs it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from typing import Any

import msgspec
import uvicorn

from engine.__main__ import make_backend, parse_args
from engine.backends.base import Backend
from wire import ChatMessage, GenerationRequest, SamplingParams

DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class InMessage(msgspec.Struct):
    role: str
    content: str


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatRequest(msgspec.Struct):
    messages: list[InMessage]
    model: str = "synthetic"
    max_tokens: int | None = None
    temperature: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class Choice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: str | None


class Chunk(msgspec.Struct):
    """The gateway's ``ChatCompletionChunk`` (gateway/apis/openai/schema.py), field for
    field, so both paths put the same bytes on the wire."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None


_decode_request = msgspec.json.Decoder(ChatRequest).decode
_encode = msgspec.json.Encoder().encode


class ReferenceEngine:
    """A bare ASGI app around one backend, started and stopped with the server."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._ids = itertools.count()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            await self.backend.start()
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await self.backend.stop()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            await _plain(send, 200, b"ok")
        elif path == "/v1/chat/completions" and method == "POST":
            await self.chat(receive, send)
        else:
            await _plain(send, 404, b"not found")

    async def chat(self, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            data = _decode_request(body)
        except msgspec.DecodeError as exc:
            await _plain(send, 400, str(exc).encode())
            return
        if not data.stream:
            await _plain(send, 400, b"only stream: true is served")
            return
        gid = f"ref{next(self._ids)}"
        temperature = 1.0 if data.temperature is None else data.temperature  # as the gateway's
        request = GenerationRequest(
            generation_id=gid,
            session_id=gid,
            params=SamplingParams(max_tokens=data.max_tokens or 256, temperature=temperature),
            messages=[ChatMessage(m.role, m.content) for m in data.messages],  # type: ignore[arg-type]
        )
        prepared = await self.backend.prepare(request)
        completion_id, created, model = f"chatcmpl-{gid}", int(time.time()), self.backend.model

        def frame(choices: list[Choice], usage: Usage | None = None) -> bytes:
            chunk = Chunk(completion_id, "chat.completion.chunk", created, model, choices, usage)
            return b"data: " + _encode(chunk) + b"\n\n"

        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        first, made = True, 0
        async for delta in self.backend.generate(prepared):
            made += len(delta.token_ids)
            if delta.text or delta.token_ids:
                out = Delta("assistant" if first else None, delta.text)
                first = False
                await send(_body(frame([Choice(0, out, None, None)])))
            if delta.finish_reason is not None:
                frames = [frame([Choice(0, Delta(), None, delta.finish_reason)])]
                if data.stream_options is not None and data.stream_options.include_usage:
                    prompt = len(prepared.prompt_token_ids)
                    frames.append(frame([], Usage(prompt, made, prompt + made)))
                await send(_body(b"".join([*frames, DONE_FRAME])))
                break
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _body(data: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": True}


async def _plain(send: Any, status: int, text: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(text)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reference_engine",
        description=__doc__,
        epilog="Every other flag is python -m engine's, for the backend.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--backend", choices=("synthetic", "vllm"), default="synthetic")
    args, engine_flags = parser.parse_known_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    backend = make_backend(parse_args(["--backend", args.backend, *engine_flags]))
    config = uvicorn.Config(
        ReferenceEngine(backend),
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        loop="uvloop",
        http="httptools",
        timeout_keep_alive=75,
        # Stopped, it ends what it streams at once: a bench stopped mid-stream (its time
        # out, a Ctrl-C) would else wait for a stream nobody reads, and be killed with the
        # rest of its rig still running.
        timeout_graceful_shutdown=1,
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":  # vLLM starts its engine process with spawn: keep this guard
    main()

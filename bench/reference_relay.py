"""The reference relay: the streaming endpoint people write first, to measure against.

``python -m bench.reference_relay --port P`` (``REDIS_URL``, ``TOKENSPOUT_KEY_PREFIX`` from the
environment) serves ``GET /stream/{session_id}``. Exactly what it does, per request:

1. a ``threading.Thread`` opens its own Redis connection (``redis.Redis``, blocking) and loops
   on ``XREAD BLOCK 1000`` over the session's event stream from the start, putting each entry
   ``(id, type, data)`` into a per-request ``queue.Queue``, and a ``None`` after the final one;
2. the response is a FastAPI ``StreamingResponse`` over an async generator that awaits
   ``loop.run_in_executor(None, queue.get)`` (the default thread pool: min(32, nproc + 4)
   threads) and yields one SSE frame (``id:``, ``event:``, ``data:``) per item, with no
   sleep and no batching: one executor hop and one write per token.

``--wait spin`` swaps step 2's executor hop for the other no-sleep way people write it: poll
``queue.get_nowait()`` and, when it is empty, ``await asyncio.sleep(0)`` (yield to the loop,
then poll again). It has the lowest latency of the two and burns CPU while streams wait.

Its upstream is therefore the same engine worker, the same sessions and the same Redis stream
entries that tokenspout relays, on the same token schedule; only the relay differs (a thread,
a Redis connection and a blocking read per stream, one write per token, no pub/sub).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import threading
from collections.abc import AsyncIterator

import redis
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from wire import DEFAULT_PREFIX, TERMINAL_EVENTS, Keys

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KEYS = Keys(os.environ.get("TOKENSPOUT_KEY_PREFIX", DEFAULT_PREFIX))
Item = tuple[bytes, bytes, bytes]
SPIN = False

app = FastAPI()


def pump(session_id: str, items: queue.Queue[Item | None]) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    stream, last = KEYS.events(session_id), b"0-0"
    try:
        while True:
            for _name, entries in client.xread({stream: last}, block=1000, count=100) or []:
                for entry_id, fields in entries:
                    last = entry_id
                    items.put((entry_id, fields[b"t"], fields[b"d"]))
                    if fields[b"t"].decode() in TERMINAL_EVENTS:
                        return
    finally:
        items.put(None)
        client.close()


@app.get("/stream/{session_id}")
async def stream(session_id: str) -> StreamingResponse:
    items: queue.Queue[Item | None] = queue.Queue()
    threading.Thread(target=pump, args=(session_id, items), daemon=True).start()

    async def frames() -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        while True:
            if SPIN:
                try:
                    item = items.get_nowait()
                except queue.Empty:
                    await asyncio.sleep(0)
                    continue
            else:
                item = await loop.run_in_executor(None, items.get)
            if item is None:
                return
            entry_id, event_type, data = item
            yield b"id: " + entry_id + b"\nevent: " + event_type + b"\ndata: " + data + b"\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream")


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reference_relay")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--wait", choices=["executor", "spin"], default="executor")
    args = parser.parse_args()
    global SPIN
    SPIN = args.wait == "spin"
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False)


if __name__ == "__main__":
    main()

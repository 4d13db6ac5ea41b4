"""Where a benchmark waits: ``kill -USR1 <pid>`` prints its thread's stack and every pending
asyncio task's ``await`` chain.

The benches are one asyncio loop each; a hang is a task awaiting something that never
comes, which a thread dump (py-spy, faulthandler) shows only as the loop's ``select``. The
tests' ``run_bench`` sends the signal before it kills a bench that ran past its time, so the
failure names the await it was stuck on.
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
SIGNAL = signal.SIGUSR1


def awaiting(awaited: Any) -> list[str]:
    """Where a coroutine waits: each frame of its ``await`` chain, down to what it awaits
    (a future, a lock's waiter...); a task's own stack stops at its first frame."""
    lines = []
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
        frame = frame or getattr(awaited, "gi_frame", None)
        if frame is None:
            lines.append(f"  awaiting {awaited!r}")
            break
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        awaited = next(
            (
                getattr(awaited, name)
                for name in ("cr_await", "ag_await", "gi_yieldfrom")
                if getattr(awaited, name, None) is not None
            ),
            None,
        )
    return lines


def print_tasks() -> None:
    """Every task of the running loop with where it waits, to stderr at once."""
    tasks = asyncio.all_tasks()
    lines = [f"[stuck] {len(tasks)} pending asyncio task(s):"]
    for task in tasks:
        lines += [f"--- {task.get_name()}:", *awaiting(task.get_coro())]
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, printing the tasks' stacks on SIGUSR1. An interrupt (SIGINT,
    Ctrl-C) cancels ``main``, so the rigs stop what they started, even where the bench was
    started with SIGINT ignored (a background job of a script: ``make test &``), which
    Python would otherwise keep, and asyncio.run then installs no handler of its own."""
    signal.signal(signal.SIGINT, signal.default_int_handler)

    async def with_handler() -> T:
        asyncio.get_running_loop().add_signal_handler(SIGNAL, print_tasks)
        # The thread's own stack at once, too: a loop blocked in synchronous code (a
        # process start waiting on /health) runs the handler above only when it is back.
        faulthandler.register(SIGNAL, chain=True)
        return await main

    return asyncio.run(with_handler())

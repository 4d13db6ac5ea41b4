"""py-spy profiles for the benchmarks, and their top frames in a few lines.

``profiling(pids, out, stem)`` records each named process while its block runs, then
summarises each file. ``record(pid, path)`` starts ``py-spy record`` (speedscope format,
busy samples only: py-spy leaves out idle threads by default) on a running process;
``stop`` ends it and waits for the file. ``summary(path)`` reads a speedscope file and ranks
functions by self time (the frame on top of the stack) and by total time (anywhere on the
stack), as shares of all samples. Open the files themselves in https://www.speedscope.app
for the whole picture.

``python -m bench.profile_top FILE...`` prints the summary of each file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

TOP = 15
IDLE = {"epoll_wait", "epoll_pwait", "EpollSelector.select", "select", "poll"}
"""Leaf frames of a thread waiting for I/O: py-spy counts some of them as busy (its idle
detection misses a loop that wakes often); the summary leaves them out and reports their
share as ``waiting``."""


def record(pid: int, out: Path, rate: int = 250, native: bool = False) -> subprocess.Popen[bytes]:
    """``native``: unwind C frames too (uvloop, hiredis, the interpreter): slower, and it
    pauses the process at each sample, but it shows where the time inside them goes."""
    py_spy = Path(sys.executable).parent / "py-spy"
    args = [str(py_spy), "record", "--pid", str(pid), "--format", "speedscope"]
    args += ["--output", str(out), "--rate", str(rate)]
    args += ["--native"] if native else ["--nonblocking"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(spy: subprocess.Popen[bytes]) -> None:
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


@contextlib.asynccontextmanager
async def profiling(
    pids: dict[str, int], out: Path, stem: str, native: bool = False
) -> AsyncIterator[dict[str, Any]]:
    """py-spy on each process of ``pids`` (by name) while the block runs, into
    ``out/STEM-NAME.speedscope.json``; the dict yielded then holds each file's summary."""
    files = {name: out / f"{stem}-{name}.speedscope.json" for name in pids}
    spies = [record(pids[name], path, native=native) for name, path in files.items()]
    await asyncio.sleep(1.0)  # py-spy attaches
    summaries: dict[str, Any] = {}
    try:
        yield summaries
    finally:
        for spy in spies:
            stop(spy)
    summaries.update({name: summary(path) for name, path in files.items()})


def _label(frame: dict[str, Any]) -> str:
    file = frame.get("file") or ""
    parts = Path(file).parts
    # Keep the package-relative tail: site-packages/redis/asyncio/client.py -> redis/asyncio/...
    for anchor in ("site-packages", "lib"):
        if anchor in parts:
            parts = parts[len(parts) - parts[::-1].index(anchor) :]
            break
    tail = "/".join(parts[-3:]) if parts else "?"
    return f"{frame.get('name', '?')} ({tail})"


OWN = ("/gateway/", "/engine/", "/bench/")
"""The project's own code: ``ours`` charges each sample to the innermost frame in it."""


def summary(path: Path, top: int = TOP) -> dict[str, Any]:
    """Shares of the busy samples in one speedscope file: by self time, by total time, and
    by ``ours`` (the innermost frame of the project's own code on the stack, so a Redis
    call or a GC pass counts against the function of ours that made it)."""
    if not path.exists():
        return {"samples": 0, "error": f"{path.name} was not written (py-spy could not attach?)"}
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    labels = [_label(frame) for frame in frames]
    idle = {index for index, frame in enumerate(frames) if frame.get("name") in IDLE}
    mine = {i for i, frame in enumerate(frames) if any(d in (frame.get("file") or "") for d in OWN)}
    ours: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    count = waiting = 0
    for profile in data["profiles"]:
        for stack in profile["samples"]:  # root first; py-spy weighs every sample alike
            if not stack:
                continue
            if stack[-1] in idle:
                waiting += 1
                continue
            count += 1
            own[labels[stack[-1]]] += 1
            inner = next((index for index in reversed(stack) if index in mine), None)
            ours[labels[inner] if inner is not None else "(outside our code)"] += 1
            for name in {labels[index] for index in stack}:
                total[name] += 1
    if not count:
        return {"samples": 0, "waiting": waiting}
    # The frames on every stack (the interpreter, the event loop's run) say nothing.
    inner = [(name, n) for name, n in total.most_common() if n < 0.98 * count]
    return {
        "samples": count,
        "waiting": waiting,
        "self": [[name, round(100 * n / count, 1)] for name, n in own.most_common(top)],
        "total": [[name, round(100 * n / count, 1)] for name, n in inner[:top]],
        "ours": [[name, round(100 * n / count, 1)] for name, n in ours.most_common(top)],
    }


def text(summaries: dict[str, Any]) -> str:
    """``{mode: {process: summary}}`` as plain text."""
    lines = []
    for mode, by_process in summaries.items():
        for process, s in by_process.items():
            busy, waiting = s.get("samples", 0), s.get("waiting", 0)
            lines.append(f"== {mode}: {process} ({busy} busy samples; {waiting} waiting in epoll)")
            if "error" in s:
                lines.append(f"   {s['error']}")
                continue
            for kind in ("ours", "self", "total"):
                lines.append(f"  by {kind} time:")
                lines += [f"    {share:5.1f} %  {name}" for name, share in s.get(kind, [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    summaries = {"files": {Path(arg).name: summary(Path(arg)) for arg in sys.argv[1:]}}
    print(text(summaries), end="")


if __name__ == "__main__":
    main()

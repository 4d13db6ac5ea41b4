"""py-spy profiles for the benchmarks, and their top frames in a few lines.

``record(pid, path)`` starts ``py-spy record`` (speedscope format, busy samples only: py-spy
leaves out idle threads by default) on a running process; ``stop`` ends it and waits for the
file. ``summary(path)`` reads a speedscope file and ranks functions by self time (the frame
on top of the stack) and by total time (anywhere on the stack), as shares of all samples.
Open the files themselves in https://www.speedscope.app for the whole picture.

``python -m bench.profile_top FILE...`` prints the summary of each file.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

TOP = 15


def record(pid: int, out: Path, rate: int = 250) -> subprocess.Popen[bytes]:
    py_spy = Path(sys.executable).parent / "py-spy"
    args = [str(py_spy), "record", "--pid", str(pid), "--format", "speedscope"]
    args += ["--output", str(out), "--rate", str(rate), "--nonblocking"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(spy: subprocess.Popen[bytes]) -> None:
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


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


def summary(path: Path, top: int = TOP) -> dict[str, Any]:
    """Self and total shares of the busy samples in one speedscope file."""
    if not path.exists():
        return {"samples": 0, "error": f"{path.name} was not written (py-spy could not attach?)"}
    data = json.loads(path.read_text())
    labels = [_label(frame) for frame in data["shared"]["frames"]]
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    count = 0
    for profile in data["profiles"]:
        weights = profile.get("weights") or [1] * len(profile["samples"])
        for stack, weight in zip(profile["samples"], weights, strict=True):
            if not stack:
                continue
            count += weight
            own[labels[stack[-1]]] += weight
            for name in {labels[index] for index in stack}:
                total[name] += weight
    if not count:
        return {"samples": 0}
    return {
        "samples": count,
        "self": [[name, round(100 * n / count, 1)] for name, n in own.most_common(top)],
        "total": [[name, round(100 * n / count, 1)] for name, n in total.most_common(top)],
    }


def text(summaries: dict[str, Any]) -> str:
    """``{mode: {process: summary}}`` as plain text."""
    lines = []
    for mode, by_process in summaries.items():
        for process, s in by_process.items():
            lines.append(f"== {mode}: {process} ({s.get('samples', 0)} busy samples)")
            if "error" in s:
                lines.append(f"   {s['error']}")
                continue
            for kind in ("self", "total"):
                lines.append(f"  by {kind} time:")
                lines += [f"    {share:5.1f} %  {name}" for name, share in s.get(kind, [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    summaries = {"files": {Path(arg).name: summary(Path(arg)) for arg in sys.argv[1:]}}
    print(text(summaries), end="")


if __name__ == "__main__":
    main()

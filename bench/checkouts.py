"""Other revisions of tokenspout to run beside this one (bench/revisions.py): each checked
out once into a scratch folder (``git archive``, the shared virtual environment linked in),
what its engine worker accepts, and an API key made by its own command line.

A revision's gateway and engine workers run from its folder (bench/rig.py ``root``); the
benchmark's side (its rig, the engine alone, the load generator) is always this checkout's,
so every revision meets the same client.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stack import processes

ROOT = processes.ROOT
HERE = "."
"""The revision named so is this checkout as it is, uncommitted changes and all."""
SCRATCH = Path(tempfile.gettempdir()) / "tokenspout-revisions"
DONE = ".tokenspout-revision"
"""Written last into a checkout's folder: its commit, once every file is there."""


@dataclass(frozen=True)
class Checkout:
    """One revision as the benchmark runs it."""

    label: str
    """What the reports call it: the name given, with its short commit."""
    ref: str
    commit: str
    root: Path
    """Where its processes run from."""


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def checkout(ref: str, scratch: Path = SCRATCH) -> Checkout:
    """``ref`` (a commit, a branch, a tag; ``HERE``: this checkout as it is) ready to run:
    checked out under ``scratch`` unless it was before."""
    if ref == HERE:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        label = f"this checkout ({commit[:7]}{'+changes' if dirty else ''})"
        return Checkout(label, ref, commit, ROOT)
    try:
        commit = git("rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError as exc:
        raise SystemExit(
            f"bench.revisions: no commit named {ref!r} ({exc.stderr.strip()})"
        ) from exc
    root = scratch / commit[:12]
    if not (root / DONE).exists():
        _archive(commit, root)
    label = ref if ref.startswith(commit[:7]) else f"{ref} ({commit[:7]})"
    return Checkout(label, ref, commit, root)


def _archive(commit: str, root: Path) -> None:
    """``commit``'s files into ``root`` (a half-made folder from before is replaced)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root, ignore_errors=True)
    making = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    archive = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
    assert archive.stdout is not None
    with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
        tar.extractall(making, filter="tar")
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed ({archive.returncode})")
    venv = ROOT / ".venv"
    if venv.exists():
        (making / ".venv").symlink_to(venv.resolve())
    (making / DONE).write_text(commit + "\n")
    making.rename(root)


def worker_flags(root: Path, flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` (``--name value`` pairs) less those ``root``'s engine worker does not
    know (its ``--help`` does not name them)."""
    known = _run(root, "-m", "engine", "--help").stdout
    kept: list[str] = []
    for name, value in zip(flags[::2], flags[1::2], strict=True):
        if name in known.split():
            kept += [name, value]
    return tuple(kept)


def make_key(root: Path, env: dict[str, str], weight: float) -> tuple[str, str] | None:
    """A key with every limit set and none ever reached, and ``weight``, made by ``root``'s
    own ``python -m gateway keys create`` on the Redis of ``env`` (``REDIS_URL``,
    ``TOKENSPOUT_KEY_PREFIX``): its id and secret; None where that revision has no keys."""
    huge = str(10**12)
    limits = [f"--{flag}" for flag in ("concurrent", "rpm", "tpm", "tpd")]
    args = ["-m", "gateway", "keys", "create", "bench", "--weight", str(weight)]
    args += [part for flag in limits for part in (flag, huge)]
    made = _run(root, *args, env=env)
    if made.returncode != 0:
        return None
    record = json.loads(made.stdout)
    return record["id"], record["key"]


def _run(
    root: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` from ``root``, as its processes run."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=root,
        env=processes.child_env(env or {}, root),
        capture_output=True,
        text=True,
        timeout=120,
    )


def cwd_of(pid: int) -> str:
    """Where process ``pid`` runs from (what the report shows of each side's processes)."""
    return os.readlink(f"/proc/{pid}/cwd")

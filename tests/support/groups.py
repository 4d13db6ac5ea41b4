"""The suite in two processes (`make test`: pytest-xdist, ``-n 2``), with every test that
runs a vLLM engine in one of them, in the order tests/conftest.py gives them.

pytest-xdist's own ``--dist loadgroup`` names a grouped test by renaming it, which pytest 9
no longer allows (the rename is lost and the group's tests spread over both processes). So
the processes that collect the tests write the ids of the group to a file the run names
(``GROUP_FILE``), and the scheduler here (``OneGroupScheduling``, a ``--dist loadscope`` whose
scope is the group for these and the test itself for the others) reads it once every
process has collected.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

GROUP_FILE = "TOKENSPOUT_TEST_GROUP_FILE"
"""The environment variable naming the file (set by the controlling process for its workers)."""
GROUP = "vllm"


def name_the_file() -> None:
    """In the controlling process, before its workers start: where they write the group."""
    handle, path = tempfile.mkstemp(prefix="tokenspout-test-group-", suffix=".json")
    os.close(handle)
    os.environ[GROUP_FILE] = path


def write_group(nodeids: Iterable[str]) -> None:
    """In a worker, once collected: the group's test ids (each worker writes the same)."""
    path = os.environ.get(GROUP_FILE)
    if path is None or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    written = Path(f"{path}.{os.environ['PYTEST_XDIST_WORKER']}")
    written.write_text(json.dumps(sorted(nodeids)))
    written.replace(path)  # whole, whichever worker's comes last


def forget_the_file() -> None:
    path = os.environ.pop(GROUP_FILE, None)
    if path is not None:
        Path(path).unlink(missing_ok=True)


class OneGroupScheduling(LoadScopeScheduling):
    """Every test its own unit of work, but the group's tests, one unit for one process."""

    _group: frozenset[str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._group is None:  # asked once every process collected
            self._group = frozenset(json.loads(Path(os.environ[GROUP_FILE]).read_text()))
        return GROUP if nodeid in self._group else nodeid

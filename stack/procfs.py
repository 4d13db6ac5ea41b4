"""What the benchmarks and tests read of a process tree from /proc: CPU time, RSS, sockets; and
its pinning to one CPU (``sched_setaffinity`` on every thread)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """The process and its descendants (a server that forks its worker counts as one)."""
    pids, index = [pid], 0
    while index < len(pids):
        for task in _tasks(pids[index]):
            try:
                children = (task / "children").read_text().split()
            except OSError:  # the thread ended while we looked
                continue
            pids += [int(child) for child in children]
        index += 1
    return pids


def _tasks(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []


def age_s(pid: int) -> float:
    """Seconds since the process started (0.0 for one that is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return 0.0
    started_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    return uptime_s - started_ticks / CLOCK_TICKS


def _cpu_one(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """User plus system CPU time (``/proc/PID/stat`` utime + stime) of a process tree, or of
    the process alone (all its threads) with ``children=False``: the load generator's tree
    holds every process of the rig."""
    if not children:
        return _cpu_one(pid)
    total = 0.0
    for p in tree(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += _cpu_one(p)
    return total


def _rss_one(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process tree."""
    total = 0
    for p in tree(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += _rss_one(p)
    return total


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def tcp_connections_to(pid: int, port: int) -> int:
    """Open TCP connections of ``pid`` whose remote end is 127.0.0.1:``port``."""
    return len(tcp_local_ports_to(pid, port))


def tcp_local_ports_to(pid: int, port: int) -> list[int]:
    """The local ports of ``pid``'s open TCP connections to 127.0.0.1:``port`` (what
    ``CLIENT LIST`` shows as each one's ``addr``)."""
    inodes = set().union(*(_socket_inodes(p) for p in tree(pid)))
    remote = f"0100007F:{port:04X}"
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[2] == remote and parts[9] in inodes:
                ports.append(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def listener_of(port: int) -> tuple[int, str] | None:
    """The process listening on TCP ``port`` (any address) and its command line; None when
    none is, or it is another user's (whose sockets /proc does not show us)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                    listening.add(parts[9])  # 0A: LISTEN
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and listening & _socket_inodes(int(entry.name)):
            return int(entry.name), command_line(int(entry.name))
    return None


def pin(pid: int, cpu: int, *, children: bool = True) -> bool:
    """Pin a process (and its tree, unless ``children`` is False) to one CPU; False where
    the machine has one CPU or refuses."""
    if not hasattr(os, "sched_setaffinity") or cpu >= (os.cpu_count() or 1):
        return False
    try:
        for p in tree(pid) if children else [pid]:
            for task in _tasks(p):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(task.name), {cpu})
    except OSError:
        return False
    return True


def command_line(pid: int) -> str:
    """A process's command line ("" when it is gone or not ours to read)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return ""


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` runs (a stopped server's children may outlive it: vLLM's
    engine core, still holding the GPU's memory); those left at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def holding_files_under(folder: Path) -> list[int]:
    """Live processes with a file under ``folder`` open (a rig's processes each write their
    log there): what outlived whatever started them."""
    folder = folder.resolve()
    holders = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not running(int(entry.name)):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if any(Path(os.readlink(fd)).is_relative_to(folder) for fd in (entry / "fd").iterdir()):
                holders.append(int(entry.name))
    return holders

"""Every Lua script of wire/lua/ as one Redis Functions library, for one Redis (or Sentinel).

A script sent with EVALSHA runs its whole text at every call: the shared functions it is
loaded behind (the ``*_core.lua`` files and emit_event.lua) are made anew each time, some
9 us of Redis's CPU a call for fair_core.lua alone, and SUBMIT carries four such files. A
library is compiled once (``FUNCTION LOAD``): its shared functions are made then, and a
call (``FCALL``) runs only its own script. The library is the shared files, then each other
file as a function of its name (``KEYS``, ``ARGV``: its keys and arguments, as for EVAL).

Its name carries a digest of its text, so processes of two versions of tokenspout each find
their own library in one Redis. Redis keeps a library with its data (persisted and
replicated): a Redis that lost its data has none, and a call answers "Function not found"
(``lost_scripts``): the caller loads it and calls again, as it does on NOSCRIPT.

A Redis Cluster keeps EVALSHA (``wire.topology.ClusterTopology``): redis-py routes an FCALL
there by asking a node for its keys (``COMMAND GETKEYS``), a round trip per call.
"""

from __future__ import annotations

import hashlib
from importlib.resources import files

from redis.exceptions import NoScriptError, ResponseError

_LUA = files("wire") / "lua"

SHARED = ("usage_core", "emit_core", "emit_event", "admit_core", "fair_core", "hold_core")
"""The files of shared functions, in the order each may use those before it."""


def lua_source(name: str) -> str:
    return (_LUA / f"{name}.lua").read_text(encoding="utf-8")


def script_names() -> list[str]:
    """Every script of wire/lua/: the files that are not shared functions."""
    names = (entry.name.removesuffix(".lua") for entry in _LUA.iterdir())
    return sorted(name for name in names if name not in SHARED and not name.startswith("."))


def lost_scripts(answer: object) -> bool:
    """``answer`` (an error raised, or a pipeline's reply) says the Redis lacks the script
    or library called (it restarted with no data, or a replica with none was promoted):
    load it and call again."""
    if isinstance(answer, NoScriptError):
        return True
    return isinstance(answer, ResponseError) and str(answer).startswith("Function not found")


class ScriptLibrary:
    """The library's text and its functions' names."""

    def __init__(self) -> None:
        scripts = script_names()
        shared = "".join(lua_source(name) for name in SHARED)
        bodies = "".join(
            f"local function script_{name}(KEYS, ARGV)\n{lua_source(name)}\nend\n"
            for name in scripts
        )
        # Every call starts from a call's state (``begin_call``, emit_core.lua): a library's
        # locals outlive the call that set them.
        registers = "".join(
            f"redis.register_function('{{library}}_{name}', "
            f"function(keys, args) begin_call() return script_{name}(keys, args) end)\n"
            for name in scripts
        )
        digest = hashlib.sha1((shared + bodies + registers).encode()).hexdigest()[:12]
        self.name = f"tokenspout_{digest}"
        registers = registers.replace("{library}", self.name)
        self.code = f"#!lua name={self.name}\n{shared}{bodies}{registers}"

    def function(self, script: str) -> str:
        """The name ``FCALL`` calls the script of wire/lua/``script``.lua by."""
        return f"{self.name}_{script}"


LIBRARY = ScriptLibrary()

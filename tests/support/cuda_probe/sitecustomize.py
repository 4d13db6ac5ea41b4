"""A torch whose CUDA entry points record their calls (tests/test_engine_start_cuda.py).

On PYTHONPATH ahead of everything, this runs as the process starts: once ``torch.cuda`` is
imported, each CUDA entry point below writes a line naming itself and the first caller
outside torch to the file ``TOKENSPOUT_CUDA_RECORD`` names, then does what it did. On a GPU
box each of them initializes CUDA or poisons a fork (``is_available`` and ``device_count``
ask the CUDA runtime): vLLM then forks an engine core that cannot use CUDA.
With ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (vLLM sets it when imported) ``is_available`` and
``device_count`` ask NVML instead, which initializes nothing: each line says which (``nvml=``).
When vLLM's engine is about to start, it writes ``engine-start`` with some of the engine
arguments it was given, and ends the process: the worker's start-up is what is under test,
not vLLM's.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

RECORD = os.environ["TOKENSPOUT_CUDA_RECORD"]
CUDA_ENTRY_POINTS = (
    "is_available",
    "device_count",
    "init",
    "_lazy_init",
    "current_device",
    "set_device",
    "get_device_name",
    "get_device_capability",
    "get_device_properties",
    "mem_get_info",
    "synchronize",
)
"""``torch.cuda``'s functions that reach the CUDA driver (``is_initialized`` does not)."""
DRIVER_CALLS = ("_cuda_getDeviceCount", "_cuda_init")
"""torch's own bindings below them (``torch._C``)."""
ENGINE_STARTS = ("from_engine_args", "from_vllm_config")


def write(line: str) -> None:
    with open(RECORD, "a") as record:
        record.write(line + "\n")


def caller() -> str:
    """The first frame outside torch and this file: who made the call."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def recording(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        nvml = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"
        write(f"cuda {name} nvml={int(nvml)} <- {caller()}")
        return call(*args, **kwargs)

    return recorded


def patch_torch_cuda(module: ModuleType) -> None:
    for name in CUDA_ENTRY_POINTS:
        setattr(module, name, recording(f"torch.cuda.{name}", getattr(module, name)))
    binding = sys.modules["torch._C"]
    for name in DRIVER_CALLS:
        if hasattr(binding, name):
            setattr(binding, name, recording(f"torch._C.{name}", getattr(binding, name)))


def engine_starts(_original: Any) -> Callable[..., Any]:
    def started(*args: Any, **_kwargs: Any) -> Any:
        engine_args = next((a for a in args if hasattr(a, "max_num_seqs")), None)
        chosen = {
            name: getattr(engine_args, name, None)
            for name in ("max_num_seqs", "gpu_memory_utilization", "max_num_batched_tokens")
        }
        write(f"engine-start {chosen} <- {caller()}")
        os._exit(0)

    return started


def patch_async_llm(module: ModuleType) -> None:
    for name in ENGINE_STARTS:
        original = getattr(module.AsyncLLM, name)
        setattr(module.AsyncLLM, name, classmethod(engine_starts(original)))


AFTER_IMPORT = {"torch.cuda": patch_torch_cuda, "vllm.v1.engine.async_llm": patch_async_llm}


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches a module of ``AFTER_IMPORT`` as soon as it has run, before anyone uses it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> Any:
        patch = AFTER_IMPORT.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, PatchAfterImport())

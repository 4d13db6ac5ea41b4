"""``python -m bench.gpu``: tokenspout against vLLM's own OpenAI server, on one machine.

The question a GPU owner asks first: what does the gateway path cost against ``vllm serve``
on the same card? Per vLLM mode (``--modes``: ``graphs``, vLLM's default CUDA graphs, and
``eager``, ``--enforce-eager``; on a CPU only ``eager``), one side after the other, never
both at once (bench/vllm_sides.py): first the stack (an embedded Redis, one ``python -m
engine --backend vllm`` worker, the gateway as ``--gateways`` 1, 2 and 4 processes), then
vLLM's server (``python -m vllm.entrypoints.openai.api_server``), the same model and the
same vLLM flags (the worker's ``max_num_batched_tokens``, read from its log, given to the
server, whose default differs). Both are driven by the same client (bench/clients.py:
``--clients`` load processes, each timing its own CPU): streamed chat completions through
the OpenAI endpoint, ``--streams`` C = 1, 64, 256, 1,024 at once, started evenly over
``--spread-s`` (1 s), ``--tokens`` 256 each (greedy, ``ignore_eos``), ``--rounds`` rounds
(the gateways in turns in each). Then on each side ``--cancels`` streams closed after
``--cancel-after`` tokens (the time until the engine stops), and on the stack ``--kills``
workers SIGKILLed mid-reply (the time to the next token; bench/engine_stop.py).

Any model (``--model`` FOLDER); ``random`` (the default): random weights in the shape of
``--shape`` (the default model's folder, ``python -m engine.model``; bench/random_model.py);
``default``: the bundled SmolLM2 itself. It takes the vLLM lock for its whole run. Results
after each side: NAME.json and NAME.md in ``--out``, NAME.png at the end (matplotlib, where
it is installed; ``--render NAME.json`` writes both again from a results file).
docs/bench.md has the method; bench/gpu_device.sh runs it on a lent GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import os
import resource
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import engine_stop, gpu_report, random_model, stats, stuck, takeover
from bench.clients import Clients
from bench.loadgen import sse_request
from bench.rig import VLLM_PROMPT
from bench.runner import chat_request
from bench.stats import Run, added, summarise
from bench.vllm_sides import (
    SERVE,
    SERVE_CPU,
    STACK_CPU,
    EngineFlags,
    Target,
    device,
    say,
    serve_side,
    stack_side,
)
from engine.model import MODEL_NAME, cache_dir, default_model_dir, prepare_default_model
from stack.rig import HOST, VLLM_LOCK

ROOT = Path(__file__).resolve().parent.parent
MODES = {"graphs": False, "eager": True}
"""A mode's name and vLLM's ``enforce_eager`` in it."""
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
"""Every vLLM of the bench (each side's) starts with these unless the environment sets them."""
WARM_STREAMS, WARM_TOKENS = 64, 8
PREFLIGHT_STREAMS, PREFLIGHT_TOKENS = 8, 16
CANCEL_MAX_TOKENS = 1024
"""What a cancelled stream asks for: more than it reads before its close."""


def model_folder(args: argparse.Namespace) -> Path:
    if args.model == "default":
        return prepare_default_model()
    if args.model == "random":
        shape = args.shape or default_model_dir()
        out = args.model_dir or cache_dir() / "models" / f"{shape.name}-random"
        return random_model.ensure(shape, out)
    return Path(args.model)


def gpu_memory_flag() -> bool:
    """Whether ``python -m engine`` takes ``--gpu-memory-utilization`` (two vLLM workers
    share one GPU only with it: each asks for 0.9 of it by default)."""
    from engine.__main__ import build_parser

    return any("--gpu-memory-utilization" in a.option_strings for a in build_parser().flags)


async def measured(
    clients: Clients, target: Target, body: bytes, streams_n: int, args: argparse.Namespace
) -> tuple[Run, float]:
    """One run of ``streams_n`` streams on ``target``: its records and what each process
    spent (bench/stats.py ``Run``), and the busiest load process's share of a core."""
    spread = args.spread_s if streams_n > 1 else 0.0
    request = sse_request(HOST, target.port, "/v1/chat/completions", {}, body)
    if target.redis is not None:
        await target.redis.config_resetstat()
    first = await stats.worker_ttft(target.worker_metrics) if target.worker_metrics else {}
    before = target.cpu_seconds()
    outcome = await clients.run(target.port, request, streams_n, spread, args.bound_s)
    after = target.cpu_seconds()
    if first and target.worker_metrics:
        now = await stats.worker_ttft(target.worker_metrics)
        first = {name: now[name] - first[name] for name in now}
    calls = {"redis": await stats.command_calls(target.redis)} if target.redis else {}
    cpu = {name: after[name] - before[name] for name in after}
    tree, own = ("worker", "worker_own") if "worker" in cpu else ("engine", "server_own")
    cpu["engine_core"] = cpu[tree] - cpu[own]
    cpu["loadgen"] = sum(outcome.cpu_s)
    records = outcome.records
    arrivals = [t for r in records for t in r.arrivals]
    starts = [r.submitted_at for r in records if r.submitted_at]
    span = max(arrivals) - min(starts) if arrivals and starts else 0.0
    failures = sorted({r.failure for r in records if r.failure})[:5]
    run = Run(records, cpu, outcome.wall_s, calls, outcome.timed_out, failures, span, first)
    return run, outcome.busiest


async def side_points(
    clients: Clients, targets: list[Target], args: argparse.Namespace, served: str
) -> dict[int, dict[str, Any]]:
    """Every point on every target of one side (the targets in turns in each round): the
    summary of each, by number of streams, then by target."""
    body = chat_request(served, VLLM_PROMPT, args.tokens, ignore_eos=True)
    warm = chat_request(served, VLLM_PROMPT, WARM_TOKENS, ignore_eos=True)
    for target in targets:  # a fresh process's first requests: imports, pools, kernels
        await measured(clients, target, warm, min(WARM_STREAMS, max(args.streams)), args)
    points: dict[int, dict[str, Any]] = {}
    for streams_n in args.streams:
        runs: dict[str, list[tuple[Run, float]]] = {t.name: [] for t in targets}
        for round_ in range(args.rounds_single if streams_n == 1 else args.rounds):
            for target in targets:
                run, busiest = await measured(clients, target, body, streams_n, args)
                runs[target.name].append((run, busiest))
                say(f"C={streams_n}, round {round_ + 1}, {target.name}: {describe(run, busiest)}")
        points[streams_n] = {}
        for target in targets:
            done = [run for run, _ in runs[target.name]]
            names = SERVE_CPU if target.name == SERVE else STACK_CPU
            summary = summarise(target.name, done, args.tokens, names)
            summary["client_busiest_core"] = max(busiest for _, busiest in runs[target.name])
            points[streams_n][target.name] = summary
    return points


def describe(run: Run, busiest: float) -> str:
    tokens = sum(len(r.arrivals) for r in run.records)
    ttft = [r.arrivals[0] - r.submitted_at for r in run.records if r.arrivals]
    rate = tokens / run.span_s if run.span_s else 0.0
    return (
        f"{tokens:,} tokens, {rate:,.0f} tok/s, TTFT p50 {stats.ms(stats.pct(ttft, 50))} ms,"
        f" busiest client {busiest:.3f} of a core"
        + (f", failures {run.failures}" if run.failures else "")
    )


async def one_mode(
    clients: Clients, args: argparse.Namespace, flags: EngineFlags, kill: bool, save: Any
) -> dict[str, Any]:
    """Both sides in one vLLM mode, the stack first; ``save(partial)`` after each."""
    result: dict[str, Any] = {"flags": flags.as_dict(), "startup_s": {}, "cancels": {}}
    logs = args.logs / ("eager" if flags.enforce_eager else "graphs")  # made by plan
    cancel = chat_request(flags.served_name, VLLM_PROMPT, CANCEL_MAX_TOKENS, ignore_eos=True)
    async with stack_side(flags.worker_args(), args.gateways, logs) as stack:
        result["startup_s"]["stack worker"] = round(stack.startup_s, 1)
        result["max_num_batched_tokens"] = stack.max_num_batched_tokens
        stack_points = await side_points(clients, stack.targets, args, flags.served_name)
        if args.cancels:
            say(f"stack: {args.cancels} streams closed after {args.cancel_after} tokens")
            first = stack.targets[0]
            result["cancels"][first.name] = await engine_stop.cancels(
                first, cancel, args.cancels, args.cancel_after
            )
        if kill:
            result["kill"] = await engine_stop.kills(
                stack, flags.worker_args(), args.kills, args.kill_after
            )
    result["points"] = [{"streams": n, "sides": sides} for n, sides in stack_points.items()]
    save(result)
    async with serve_side(flags, stack.max_num_batched_tokens, logs) as (target, startup, version):
        result["startup_s"][SERVE] = round(startup, 1)
        result["vllm_version"] = version
        serve_points = await side_points(clients, [target], args, flags.served_name)
        if args.cancels:
            say(f"{SERVE}: {args.cancels} streams closed after {args.cancel_after} tokens")
            result["cancels"][SERVE] = await engine_stop.cancels(
                target, cancel, args.cancels, args.cancel_after
            )
    for point in result["points"]:
        alone = point["sides"][SERVE] = serve_points[point["streams"]][SERVE]
        point["added"] = {
            name: added(side, alone) for name, side in point["sides"].items() if name != SERVE
        }
    save(result)
    return result


def kill_plan(args: argparse.Namespace, kind: str) -> tuple[bool, str | None, float | None]:
    """Whether the kill runs, why not, and the GPU memory share each vLLM then takes."""
    if not args.kills:
        return False, "--kills 0", None
    if kind == "cpu":
        return True, None, None
    if not gpu_memory_flag():
        why = (
            "skipped: python -m engine has no --gpu-memory-utilization, and a second vLLM"
            " worker cannot start beside the first on one GPU (each asks 0.9 of it)"
        )
        return False, why, None
    return True, None, args.gpu_memory_utilization


def plan(args: argparse.Namespace, began: float) -> tuple[dict[str, Any], dict[str, EngineFlags]]:
    """The results' head (device, machine, model, settings) and each mode's vLLM flags: the
    device found, the model made or found, the modes' log folders made."""
    found = device()
    kind = found["kind"]
    modes = args.modes or (["graphs", "eager"] if kind == "gpu" else ["eager"])
    if kind == "cpu" and "graphs" in modes:
        raise SystemExit("bench.gpu: on a CPU vLLM runs eager only (--modes eager)")
    kill, why_not, memory = kill_plan(args, kind)
    say(f"device: {found['gpus'] or 'no GPU: vLLM on the CPU'}; modes {modes}")
    if why_not:
        say(f"worker kill {why_not}")
    folder = model_folder(args)
    named = args.model in ("default", "random")
    served = args.served_model_name or (MODEL_NAME if named else folder.name)
    results: dict[str, Any] = {
        "device": found,
        "machine": stats.machine(),
        "model": {"asked": args.model, "folder": str(folder), "served_name": served},
        "settings": json.loads(json.dumps(vars(args), default=str)),
        "kill": why_not,
        "kill_planned": kill,
        "began": began,
        "modes": {},
    }
    flags = {
        mode: EngineFlags(
            str(folder),
            served,
            args.dtype or ("auto" if kind == "gpu" else "float32"),
            args.max_model_len,
            args.max_num_seqs or max(args.streams),
            MODES[mode],
            memory if kill else None,
        )
        for mode in modes
    }
    for mode in modes:
        (args.logs / mode).mkdir(parents=True, exist_ok=True)
    return results, flags


async def measure(
    args: argparse.Namespace, results: dict[str, Any], modes: dict[str, EngineFlags]
) -> dict[str, Any]:
    """Every mode in turn (none past ``--deadline-s``), ``results`` saved after each side."""
    began = results.pop("began")

    def save(mode: str) -> Any:
        def write(partial: dict[str, Any]) -> None:
            results["modes"][mode] = partial
            results["elapsed_s"] = round(time.monotonic() - began, 1)
            gpu_report.write(args.out, args.name, results, plot=False)

        return write

    clients = Clients(args.clients)
    try:
        await clients.start()
        last = 0.0
        for index, (mode, flags) in enumerate(modes.items()):
            elapsed = time.monotonic() - began
            if index and args.deadline_s and elapsed + last > args.deadline_s:
                results["modes"][mode] = {
                    "skipped": f"--deadline-s {args.deadline_s:g}: "
                    f"{elapsed:.0f} s gone, the last mode took {last:.0f} s"
                }
                say(f"{mode}: {results['modes'][mode]['skipped']}")
                continue
            say(f"{mode}: {flags}")
            kill = results["kill_planned"] and index == 0
            await one_mode(clients, args, flags, kill, save(mode))
            last = time.monotonic() - began - elapsed
    finally:
        clients.close()
    results["elapsed_s"] = round(time.monotonic() - began, 1)
    return results


async def preflight(args: argparse.Namespace) -> dict[str, Any]:
    """The stack alone on the synthetic engine (no vLLM, seconds): a few streams through
    each gateway, a cancel and a kill, by the bench's own code; a machine that fails it
    would fail the bench after vLLM spent minutes starting (a lent GPU: a missing wheel, a
    child without the packages' folder on its path)."""
    body = chat_request("synthetic", VLLM_PROMPT, PREFLIGHT_TOKENS, ignore_eos=True)
    cancel = chat_request("synthetic", VLLM_PROMPT, CANCEL_MAX_TOKENS, ignore_eos=True)
    result: dict[str, Any] = {"device": device(), "streams": {}}
    clients = Clients(args.clients)
    try:
        await clients.start()
        async with stack_side(takeover.SYNTHETIC, args.gateways, args.logs / "preflight") as side:
            for target in side.targets:
                run, busiest = await measured(clients, target, body, PREFLIGHT_STREAMS, args)
                say(f"preflight, {target.name}: {describe(run, busiest)}")
                summary = summarise(target.name, [run], PREFLIGHT_TOKENS, STACK_CPU)
                result["streams"][target.name] = summary
            result["cancels"] = await engine_stop.cancels(side.targets[0], cancel, 1, 3)
            result["kill"] = await engine_stop.kills(side, takeover.SYNTHETIC, 1, 5)
    finally:
        clients.close()
    short = [
        name for name, m in result["streams"].items() if m["complete_streams"] < PREFLIGHT_STREAMS
    ]
    result["passed"] = not short
    if short:
        say(f"preflight failed: streams short through {short} (logs: {args.logs})")
    return result


def open_files() -> None:
    """Descriptors up to the hard limit for this process and every one it starts: at
    C = 1,024 one gateway process (and vLLM's server) holds a socket per stream, past the
    1,024 a soft limit often allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


@contextlib.contextmanager
def vllm_lock() -> Any:
    """The lock every vLLM of the tests and benchmarks takes: no two at once on a box."""
    with VLLM_LOCK.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for {VLLM_LOCK}: another vLLM runs")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--model", default="random", help="a model folder, 'random' (the default) or 'default'")
    add("--shape", type=Path, default=None, help="random: the model folder whose shape to take")
    add("--model-dir", type=Path, default=None, help="random: where to keep the model")
    add("--served-model-name", default=None, help="default: SmolLM2-135M-Instruct or the folder")
    add("--streams", type=int, nargs="+", default=[1, 64, 256, 1024], help="C, streams at once")
    add("--tokens", type=int, default=256, help="tokens per stream (ignore_eos)")
    add("--spread-s", type=float, default=1.0, help="the C streams start evenly over this")
    add("--rounds", type=int, default=1, help="rounds of each point past one stream")
    add("--rounds-single", type=int, default=3, help="rounds of the one-stream point")
    add("--gateways", type=int, nargs="+", default=[1, 2, 4], help="gateway processes, in turns")
    add(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=None,
        help="vLLM modes (default: graphs eager on a GPU, eager on a CPU)",
    )
    add(
        "--clients",
        type=int,
        default=max(1, min(4, (os.cpu_count() or 1) // 4)),
        help="load processes (default: a quarter of the cores, 1 to 4)",
    )
    add("--dtype", default=None, help="vLLM dtype (default: auto on a GPU, float32 on a CPU)")
    add("--max-model-len", type=int, default=2048)
    add(
        "--max-num-seqs",
        type=int,
        default=None,
        help="vLLM's (the worker's --capacity); default: the largest C",
    )
    add(
        "--gpu-memory-utilization",
        type=float,
        default=0.4,
        help="each vLLM's share of the GPU when a kill runs (two workers at once)",
    )
    add("--cancels", type=int, default=5, help="streams closed early, per side and mode")
    add("--cancel-after", type=int, default=16, help="tokens read before a cancel's close")
    add("--kills", type=int, default=1, help="workers SIGKILLed mid-reply (first mode)")
    add("--kill-after", type=int, default=20, help="tokens read before the kill")
    add("--bound-s", type=float, default=300.0, help="the longest one run may take")
    add(
        "--deadline-s",
        type=float,
        default=0.0,
        help="no mode starts past this (less the last mode's time); 0: none",
    )
    add("--out", type=Path, default=ROOT / "docs" / "bench")
    add("--name", default=None, help="NAME.json/.md/.png (default: vllm-serve-gpu or -cpu)")
    add("--logs", type=Path, default=None, help="the processes' logs (default: a temporary dir)")
    add("--no-plot", action="store_true")
    add("--render", type=Path, default=None, help="only write NAME.md and .png from this JSON")
    add(
        "--preflight",
        action="store_true",
        help="only the stack on the synthetic engine (no"
        " vLLM, seconds): a few streams per gateway, a cancel, a kill; OUT/preflight.json",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:  # every process it started is stopped by now
        say(f"stopped by a signal; what was measured is in {args.out} (logs: {args.logs})")
        raise SystemExit(130) from None


def run(args: argparse.Namespace) -> None:
    if args.render is not None:
        results = json.loads(args.render.read_text())
        args.name = args.name or args.render.stem
        gpu_report.write(args.out, args.name, results, plot=not args.no_plot)
        say(f"written: {args.out}/{args.name}.md")
        return
    for name, value in VLLM_ENV.items():
        os.environ.setdefault(name, value)
    # SIGTERM (timeout(1), a session's end) as Ctrl-C: every process started is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    open_files()
    began = time.monotonic()
    args.logs = args.logs or Path(tempfile.mkdtemp(prefix="tokenspout-gpu-"))
    if args.preflight:
        (args.logs / "preflight").mkdir(parents=True, exist_ok=True)
        checked = stuck.run(preflight(args))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "preflight.json").write_text(json.dumps(checked, indent=1) + "\n")
        say(f"preflight {'passed' if checked['passed'] else 'FAILED'}: {args.out}/preflight.json")
        raise SystemExit(0 if checked["passed"] else 1)
    with vllm_lock():
        results, modes = plan(args, began)
        args.name = args.name or f"vllm-serve-{results['device']['kind']}"
        say(f"process logs in {args.logs}; results: {args.out}/{args.name}.*")
        results = stuck.run(measure(args, results, modes))
    plot = not args.no_plot and importlib.util.find_spec("matplotlib") is not None
    gpu_report.write(args.out, args.name, results, plot=plot)
    say(
        f"done in {results['elapsed_s']} s: {args.out}/{args.name}.md"
        + ("" if plot or args.no_plot else " (no matplotlib: no plot; --render makes it)")
    )


if __name__ == "__main__":
    main()

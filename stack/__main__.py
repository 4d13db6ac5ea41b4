"""``python -m stack`` (``make run``): the whole product on this machine.

Starts an embedded Redis (unless ``REDIS_URL`` is set), one engine worker (vLLM on the
bundled SmolLM2 by default), and the gateway, which also serves the web chat. Each
``--add-engine "ARGS"`` starts one more worker with those ``python -m engine`` arguments,
e.g. a second model: ``--add-engine "--backend synthetic --served-model-name echo"``. Ctrl-C stops
everything; the embedded Redis keeps no data (nothing is written to disk) unless
``--persist DIR`` is given.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gateway.apis.admin.cli import STACK_PID, stack_env_path
from stack import processes, procfs
from stack.redis_server import EmbeddedRedis

DRAIN_S = 5.0
"""Ctrl-C lets running replies finish this long; below ``processes.stop``'s 15 s, so the
engine drains and exits by itself instead of being killed."""


def say(message: str) -> None:
    print(f"[tokenspout] {message}", file=sys.stderr, flush=True)


def first_model(base: str) -> str:
    """A model with a live worker, as ``/ready`` lists them (for the curl example)."""
    with urllib.request.urlopen(f"{base}/ready", timeout=5) as response:
        models: dict[str, int] = json.load(response)["models"]
    return next((name for name, workers in sorted(models.items()) if workers), "MODEL")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stack", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=int(os.environ.get("TOKENSPOUT_GRPC_PORT", "8001")),
        help="the gateway's KServe v2 / Triton gRPC port; 0: none",
    )
    parser.add_argument(
        "--workers",
        default="auto",
        help="gateway processes (python -m gateway --workers): 'auto' is one below 8 cores",
    )
    parser.add_argument("--backend", choices=["vllm", "synthetic"], default="vllm")
    parser.add_argument("--model", default="default")
    parser.add_argument("--persist", type=Path, default=None, help="keep Redis data here")
    parser.add_argument(
        "--add-engine",
        action="append",
        default=[],
        metavar="ARGS",
        help="one more engine worker with these `python -m engine` arguments (repeatable)",
    )
    return parser


class StopSignal:
    """Ctrl-C (SIGINT) or SIGTERM: whatever is waited for stops waiting, and everything
    started is stopped."""

    def __init__(self) -> None:
        self.given = False
        signal.signal(signal.SIGINT, self.give)
        signal.signal(signal.SIGTERM, self.give)

    def give(self, *_: object) -> None:
        self.given = True

    def __call__(self) -> bool:
        return self.given


def check_ports(args: argparse.Namespace) -> None:
    """Exit at once, in one line, when a port the gateway needs is taken (another make run
    holds it, say): before anything starts, rather than a gateway that dies on it while
    this one waits on the other's."""
    wanted = [(args.port, "HTTP", "PORT=8010 make run")]
    if args.grpc_port:
        wanted.append((args.grpc_port, "gRPC", "TOKENSPOUT_GRPC_PORT=8011 make run (0: none)"))
    for port, what, instead in wanted:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind((args.host, port))
                continue
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    sys.exit(f"[tokenspout] cannot listen on {args.host}:{port}: {exc.strerror}")
        holder = procfs.listener_of(port)
        by = f"pid {holder[0]} ({' '.join(holder[1].split())[:120]})" if holder else "another user"
        sys.exit(f"[tokenspout] the {what} port {port} is taken by {by}: stop it, or {instead}")


def write_stack_env(url: str) -> Path:
    """Where this stack's Redis is, for the operator's tools (``python -m gateway keys``)."""
    path = stack_env_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = os.environ.get("TOKENSPOUT_KEY_PREFIX")
    lines = [
        f"# written by make run (python -m stack, pid {os.getpid()}) while it runs",
        f"REDIS_URL={url}",
        *([f"TOKENSPOUT_KEY_PREFIX={prefix}"] if prefix else []),
        f"{STACK_PID}={os.getpid()}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def remove_stack_env(path: Path) -> None:
    """The file, unless another make run has written its own since."""
    try:
        if f"{STACK_PID}={os.getpid()}\n" in path.read_text():
            path.unlink()
    except OSError:
        return


def start_redis(args: argparse.Namespace) -> tuple[EmbeddedRedis | None, str]:
    """The embedded Redis, unless ``REDIS_URL`` names one; and the URL to use."""
    url = os.environ.get("REDIS_URL")
    if url is not None:
        return None, url
    redis = EmbeddedRedis(data_dir=args.persist, persist=args.persist is not None)
    redis.start()
    kept = f"kept in {args.persist}" if args.persist else "removed at exit"
    say(f"embedded Redis (valkey) on {redis.url}, data in {redis.data_dir} ({kept})")
    return redis, redis.url


def start_engines(
    args: argparse.Namespace, env: dict[str, str], children: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes]:
    """The engine worker, and each ``--add-engine``; returns the first."""
    say(f"starting the engine worker ({args.backend}, model {args.model})")
    # hermes: tool_choice auto works with the bundled model, as with
    # `vllm serve --enable-auto-tool-choice --tool-call-parser hermes`.
    tools = ["--tool-call-parser", "hermes"]
    engine = processes.engine(
        ["--backend", args.backend, "--model", args.model, *tools, "--drain-s", str(DRAIN_S)],
        env,
    )
    children.append(engine)
    for extra in args.add_engine:
        say(f"starting another engine worker: {extra}")
        children.append(processes.engine([*shlex.split(extra), "--drain-s", str(DRAIN_S)], env))
    return engine


def wait_ready(base: str, engine: subprocess.Popen[bytes], began: float, stop: StopSignal) -> bool:
    """Until the gateway says an engine worker is ready (False: stopped first)."""
    if not stop():
        say("waiting for the engine to load the model (vLLM on a CPU: about a minute)")
    deadline = time.monotonic() + 900
    while not stop() and time.monotonic() < deadline:
        try:
            processes.wait_http(f"{base}/ready", engine, 5, stopped=stop)
            break
        except TimeoutError:
            say(f"  still loading ({time.monotonic() - began:.0f} s)")
    return not stop()


def say_how_to_use(base: str) -> None:
    model = first_model(base)
    print(f"\n  tokenspout is running: {base}\n", flush=True)
    print(
        f"  try:  curl -N {base}/v1/chat/completions -H 'content-type: application/json'"
        f' -d \'{{"model":"{model}","stream":true,"messages":[{{"role":"user",'
        '"content":"Hi"}]}\'',
        flush=True,
    )
    if os.environ.get("TOKENSPOUT_API_KEYS") or os.environ.get("TOKENSPOUT_API_KEYS_FILE"):
        print(
            "  API keys are on: add  -H 'Authorization: Bearer <key>'  to API calls"
            " and session creation; the web chat asks for a key",
            flush=True,
        )
    else:
        print(
            "  API endpoints are open: TOKENSPOUT_API_KEYS=key1,key2 make run requires Bearer keys",
            flush=True,
        )
    print("  stop: Ctrl-C\n", flush=True)


def main() -> None:
    args = parser().parse_args()
    redis: EmbeddedRedis | None = None
    children: list[subprocess.Popen[bytes]] = []
    stop = StopSignal()
    check_ports(args)
    env_file: Path | None = None
    try:
        redis, url = start_redis(args)
        env_file = write_stack_env(url)
        say(f"REDIS_URL={url} is in {env_file} while this runs (python -m gateway keys reads it)")
        env = {"REDIS_URL": url}
        began = time.monotonic()
        engine = start_engines(args, env, children)
        grpc = f" (gRPC on {args.host}:{args.grpc_port})" if args.grpc_port else ""
        say(f"starting the gateway on http://{args.host}:{args.port}{grpc}")
        gateway = processes.gateway(
            args.port, env, host=args.host, grpc_port=args.grpc_port, workers=args.workers
        )
        children.append(gateway)
        base = f"http://{args.host}:{args.port}"
        processes.wait_http(f"{base}/health", gateway, 60, stopped=stop)
        if wait_ready(base, engine, began, stop):
            say(f"ready in {time.monotonic() - began:.0f} s")
            say_how_to_use(base)
        while not stop() and all(child.poll() is None for child in children):
            time.sleep(0.2)
        for child in children:
            if child.poll() is not None and not stop():
                say(f"{child.args!r} exited with {child.returncode}; stopping")
    finally:
        say("stopping")
        for child in reversed(children):
            processes.stop(child)
        if redis is not None:
            redis.cleanup()
        if env_file is not None:
            remove_stack_env(env_file)
        say("stopped")


if __name__ == "__main__":
    main()

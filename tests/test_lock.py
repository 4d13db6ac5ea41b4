"""constraints.txt pins every package `make setup` installs, and satisfies pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCKED_EXTRAS = ("engine-cpu", "dev")
"""engine-gpu is installed in its own environment on a GPU box, never beside these."""
REMOVED_AFTER_INSTALL = {"torchvision", "torchaudio", "torchcodec"}


def locked() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and name and version, f"not a pin: {line!r}"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def wanted() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in LOCKED_EXTRAS:
        lines += project["optional-dependencies"][extra]
    makefile = (ROOT / "Makefile").read_text()
    no_deps = re.search(r"--no-deps ([\w\- ]+)\n", makefile)
    assert no_deps, "the Makefile's --no-deps install line moved"
    lines += no_deps.group(1).split()
    return [Requirement(line) for line in lines]


def test_every_requirement_of_pyproject_is_pinned_within_its_range() -> None:
    pins = locked()
    for requirement in wanted():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in constraints.txt: run `make lock`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, pyproject wants {requirement}"
        )


def test_the_environment_holds_exactly_the_locked_versions() -> None:
    pins = locked()
    installed = {
        canonicalize_name(dist.metadata["Name"]): Version(dist.version)
        for dist in metadata.distributions()
    }
    installed.pop("tokenspout", None)
    for name in REMOVED_AFTER_INSTALL:
        assert name not in installed, f"{name} breaks vLLM's imports and should be gone"
    unlocked = sorted(set(installed) - set(pins))
    assert not unlocked, f"installed but not locked: {unlocked}"
    differ = {n: (str(v), str(pins[n])) for n, v in installed.items() if pins[n] != v}
    assert not differ, f"installed vs locked: {differ}"

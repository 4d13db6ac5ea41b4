"""The vendored browser libraries are exactly the pinned files their READMEs list."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \|$", re.MULTILINE)


def test_every_vendored_web_file_is_listed_with_its_sha256_and_matches_it() -> None:
    vendor = ROOT / "web" / "vendor"
    listed = dict(ROW.findall((vendor / "README.md").read_text()))
    shipped = {
        str(path.relative_to(vendor))
        for path in vendor.rglob("*")
        if path.is_file() and path.name not in ("README.md",) and "LICENSE" not in path.name
    }
    assert shipped == set(listed), "web/vendor/README.md lists another set of files"
    for name, digest in listed.items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
    for library in {Path(name).parts[0] for name in listed}:
        assert (vendor / library / "LICENSE").is_file(), library


def test_the_tests_axe_core_is_the_pinned_release_with_its_licence() -> None:
    data = ROOT / "tests" / "data"
    note = (data / "README.md").read_text()
    digest = re.search(r"\(`axe-core/axe.min.js`\): `([0-9a-f]{64})`", note)
    assert digest is not None
    axe = (data / "axe-core" / "axe.min.js").read_bytes()
    assert hashlib.sha256(axe).hexdigest() == digest.group(1)
    assert b"axe v4.14.1" in axe[:200]
    assert (data / "axe-core" / "LICENSE").read_text().startswith("Mozilla Public License")

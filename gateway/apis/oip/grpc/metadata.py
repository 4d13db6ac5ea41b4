"""``ModelMetadata``: the tensors an LLM model served through tokenspout takes and gives."""

from __future__ import annotations

from gateway.apis.oip.grpc.protocol import pb
from gateway.apis.oip.grpc.tensors import TEXT_INPUT, TEXT_OUTPUT

INPUTS = [
    (TEXT_INPUT, "BYTES", [1]),
    ("max_tokens", "INT32", [1]),
    ("temperature", "FP32", [1]),
    ("top_p", "FP32", [1]),
    ("top_k", "INT32", [1]),
    ("seed", "UINT64", [1]),
    ("stop", "BYTES", [-1]),
    ("stream", "BOOL", [1]),
    ("sampling_parameters", "BYTES", [1]),
]
"""Every input but ``text_input`` is optional (and may come as a request parameter too)."""
OUTPUTS = [(TEXT_OUTPUT, "BYTES", [1])]


def model_metadata(name: str, backend: str) -> pb.ModelMetadataResponse:
    """``backend``: what the model's workers run (``vllm``, ``synthetic``), as the platform."""
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=name,
        versions=["1"],
        platform=f"tokenspout/{backend}",
        inputs=[tensor(name=n, datatype=d, shape=s) for n, d, s in INPUTS],
        outputs=[tensor(name=n, datatype=d, shape=s) for n, d, s in OUTPUTS],
    )

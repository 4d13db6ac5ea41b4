"""A KServe v2 ``ModelInferRequest`` as an LLM request, and the responses' tensors.

The tensors are named as Triton's LLM backends (vLLM, TensorRT-LLM) and MLServer name them:
a ``text_input`` BYTES input holding one prompt; ``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``stop`` (or ``stop_words``), ``seed`` (or ``random_seed``) and ``stream`` as
inputs of one element or as request parameters; the vLLM backend's ``sampling_parameters``
(a JSON object in one BYTES element) too. They meet the REST generate extension's
validation (gateway/apis/oip/routes.py ``Parameters``). Out: one ``text_output`` BYTES element.

Tensor data comes either in ``raw_input_contents`` (what tritonclient sends: little-endian
values, BYTES elements each behind a 4-byte length) or in each input's typed ``contents``.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, NamedTuple

import msgspec

from gateway.apis.oip.grpc.protocol import pb
from gateway.apis.oip.routes import Parameters
from gateway.core.errors import BadRequest, not_json

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
FINAL_RESPONSE = "triton_final_response"
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
ALIASES = {"stop_words": "stop", "random_seed": "seed"}
"""TensorRT-LLM's input names for what the REST generate extension calls ``stop``, ``seed``."""
LIST_FIELDS = frozenset({"stop"})
IGNORED_PARAMETERS = frozenset({"priority", "timeout"})
"""Set by tritonclient's ``infer`` arguments; the queue is first come, first served and a
generation's limits are the gateway's own (``TOKENSPOUT_QUEUE_TIMEOUT_S``)."""

_FIXED = {
    "BOOL": "?",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "FP32": "f",
    "FP64": "d",
}
"""struct formats of the fixed-size datatypes (FP16 and BF16 carry no LLM field)."""
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_EXPECTED = {
    "max_tokens": "INT",
    "top_k": "INT",
    "seed": "INT",
    "temperature": "FP",
    "top_p": "FP",
    "stream": "BOOL",
    "stop": "BYTES",
    "sampling_parameters": "BYTES",
}
"""The datatype family each input must have (an INT input: any INT or UINT)."""


class LlmRequest(NamedTuple):
    model: str
    id: str
    prompt: str
    parameters: Parameters
    empty_final: bool
    """The client asked for an empty final response (tritonclient's
    ``enable_empty_final_response``): the final one then carries no ``text_output``."""


def read_request(request: pb.ModelInferRequest) -> LlmRequest:
    """The request's prompt and parameters; ``BadRequest`` naming what is wrong."""
    if not request.model_name:
        raise BadRequest("`model_name` is required", field="model_name")
    fields: dict[str, Any] = {}
    empty_final = False
    for name, parameter in request.parameters.items():
        if name == EMPTY_FINAL_RESPONSE:
            empty_final = _parameter_value(name, parameter) is True
        elif name not in IGNORED_PARAMETERS:
            _put(fields, name, _parameter_value(name, parameter))
    prompt: str | None = None
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs; "
            "shared memory is not supported"
        )
    for index, tensor in enumerate(request.inputs):
        values = _values(tensor, raw[index] if raw else None)
        if tensor.name == TEXT_INPUT:
            if tensor.datatype != "BYTES":
                raise BadRequest(
                    f"input `{TEXT_INPUT}` must be BYTES, not {tensor.datatype}", field=TEXT_INPUT
                )
            if len(values) != 1:
                raise BadRequest(
                    f"input `{TEXT_INPUT}` must hold one prompt, not {len(values)} "
                    "(send one request per prompt)",
                    field=TEXT_INPUT,
                )
            prompt = _text(values[0], TEXT_INPUT)
        else:
            _put(fields, tensor.name, _input_value(tensor, values))
    for output in request.outputs:
        if output.name != TEXT_OUTPUT:
            raise BadRequest(
                f"unknown output `{output.name}`: this model has only `{TEXT_OUTPUT}`",
                field=output.name,
            )
    if prompt is None:
        raise BadRequest(f"input `{TEXT_INPUT}` (BYTES) is required", field=TEXT_INPUT)
    if not prompt.strip():
        raise BadRequest(f"input `{TEXT_INPUT}` must not be empty", field=TEXT_INPUT)
    try:
        parameters = msgspec.convert(fields, Parameters)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid parameter: {exc}") from None
    return LlmRequest(request.model_name, request.id, prompt, parameters, empty_final)


def _put(fields: dict[str, Any], name: str, value: Any) -> None:
    if name == "sampling_parameters":
        given = _sampling_parameters(value)
        for key, item in given.items():
            _put(fields, key, item)
        return
    key = ALIASES.get(name, name)
    if key not in Parameters.__struct_fields__:
        known = sorted({*Parameters.__struct_fields__, *ALIASES, "sampling_parameters"})
        raise BadRequest(
            f"unknown input or parameter `{name}` (known: {TEXT_INPUT}, {', '.join(known)})",
            field=name,
        )
    fields[key] = value


def _sampling_parameters(value: Any) -> dict[str, Any]:
    """The vLLM backend's ``sampling_parameters``: a JSON object as text."""
    try:
        given = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        where = not_json(value.encode(), "`sampling_parameters`")
        raise BadRequest(where.message, field="sampling_parameters") from None
    if not isinstance(given, dict):
        raise BadRequest("`sampling_parameters` must be a JSON object", field="sampling_parameters")
    return given


def _parameter_value(name: str, parameter: pb.InferParameter) -> Any:
    choice = parameter.WhichOneof("parameter_choice")
    if choice is None:
        raise BadRequest(f"parameter `{name}` has no value", field=name)
    value = getattr(parameter, choice)
    if choice == "string_param":
        return _from_text(ALIASES.get(name, name), value)
    return value


def _from_text(key: str, value: str) -> Any:
    """A parameter sent as text (tritonclient sends no float parameters): a number where
    the field is one."""
    if key in ("temperature", "top_p"):
        try:
            return float(value)
        except ValueError:
            return value  # msgspec names the field and the type it wanted
    return value


def _input_value(tensor: pb.ModelInferRequest.InferInputTensor, values: list[Any]) -> Any:
    name = tensor.name
    family = _EXPECTED.get(ALIASES.get(name, name))
    if family is not None and not _datatype_fits(tensor.datatype, family):
        raise BadRequest(f"input `{name}` must be {family}*, not {tensor.datatype}", field=name)
    if tensor.datatype == "BYTES":
        values = [_text(value, name) for value in values]
    if ALIASES.get(name, name) in LIST_FIELDS:
        return values
    if len(values) != 1:
        raise BadRequest(f"input `{name}` must hold one element, not {len(values)}", field=name)
    return values[0]


def _datatype_fits(datatype: str, family: str) -> bool:
    if family == "INT":
        return datatype.startswith(("INT", "UINT"))
    return datatype.startswith(family)


def _values(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> list[Any]:
    """The tensor's elements, checked against its shape."""
    name, datatype = tensor.name, tensor.datatype
    if "shared_memory_region" in tensor.parameters:
        raise BadRequest(f"input `{name}`: shared memory is not supported", field=name)
    if datatype != "BYTES" and datatype not in _FIXED:
        raise BadRequest(f"input `{name}`: datatype {datatype!r} is not supported", field=name)
    if raw is not None:
        values = _unpack_bytes(raw, name) if datatype == "BYTES" else _unpack(raw, datatype, name)
    else:
        values = list(getattr(tensor.contents, _CONTENTS[datatype]))
    count = math.prod(tensor.shape)
    if any(dim < 0 for dim in tensor.shape) or count != len(values):
        raise BadRequest(
            f"input `{name}` has shape {list(tensor.shape)} but {len(values)} elements",
            field=name,
        )
    return values


def _unpack(raw: bytes, datatype: str, name: str) -> list[Any]:
    size = struct.calcsize(_FIXED[datatype])
    if len(raw) % size:
        raise BadRequest(f"input `{name}`: {len(raw)} bytes are no {datatype} values", field=name)
    return list(struct.unpack(f"<{len(raw) // size}{_FIXED[datatype]}", raw))


def _unpack_bytes(raw: bytes, name: str) -> list[bytes]:
    """BYTES elements as the protocol serializes them: a 4-byte little-endian length each."""
    values, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise BadRequest(f"input `{name}`: truncated BYTES element", field=name)
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise BadRequest(f"input `{name}`: truncated BYTES element", field=name)
        values.append(raw[offset : offset + length])
        offset += length
    return values


def _text(value: bytes, name: str) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise BadRequest(f"input `{name}` must be UTF-8 text", field=name) from None


def text_response(
    request: LlmRequest,
    model: str,
    text: str | None,
    *,
    final: bool | None = None,
    **parameters: str | int,
) -> pb.ModelInferResponse:
    """A response with ``text`` as its ``text_output`` (None: no output, an empty final
    response), ``triton_final_response`` when ``final`` is given, and ``parameters``."""
    response = pb.ModelInferResponse(model_name=model, id=request.id)
    if text is not None:
        data = text.encode()
        response.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
        response.raw_output_contents.append(struct.pack("<I", len(data)) + data)
    if final is not None:
        response.parameters[FINAL_RESPONSE].bool_param = final
    for key, value in parameters.items():
        if isinstance(value, str):
            response.parameters[key].string_param = value
        else:
            response.parameters[key].int64_param = value
    return response


class TokenResponses:
    """One request's token responses (``ModelStreamInferResponse``, not final) written by
    hand: a message's fields concatenate, so the fields every token repeats (model, id,
    the output's description, ``triton_final_response`` false) are serialized once, with
    protobuf, and each token appends its ``raw_output_contents`` element. tritonclient
    reads it as it reads ``text_response``'s (tests/inprocess/test_grpc_protocol.py)."""

    def __init__(self, request: LlmRequest, model: str) -> None:
        head = pb.ModelInferResponse(model_name=model, id=request.id)
        head.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
        head.parameters[FINAL_RESPONSE].bool_param = False
        self._head = head.SerializeToString()

    def token(self, text: str) -> bytes:
        data = text.encode()
        element = struct.pack("<I", len(data)) + data
        # ModelInferResponse.raw_output_contents (field 6, length-delimited) ...
        response = b"%s\x32%s%s" % (self._head, _varint(len(element)), element)
        # ... inside ModelStreamInferResponse.infer_response (field 2, length-delimited).
        return b"\x12%s%s" % (_varint(len(response)), response)


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)

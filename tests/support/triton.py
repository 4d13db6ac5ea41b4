"""The official Triton client (``tritonclient.grpc``) against a gateway's gRPC server: the
LLM tensors as Triton's LLM backends name them, and a stream's responses collected per
request id from ``start_stream``'s callback."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc._utils import _get_inference_request
from tritonclient.utils import InferenceServerException

WAIT_S = 60.0


def text_input(prompt: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    return tensor


def scalar(name: str, value: Any, datatype: str) -> grpcclient.InferInput:
    dtypes = {"INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_, "UINT64": np.uint64}
    tensor = grpcclient.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(np.array([value], dtype=dtypes[datatype]))
    return tensor


def llm_inputs(prompt: str, max_tokens: int, **more: tuple[Any, str]) -> list[Any]:
    """``text_input`` and ``max_tokens`` (INT32), then ``name=(value, datatype)`` inputs."""
    inputs = [text_input(prompt), scalar("max_tokens", max_tokens, "INT32")]
    return inputs + [scalar(name, value, datatype) for name, (value, datatype) in more.items()]


def sent(inputs: list[Any], model: str = "alpha", request_id: str = "r-1", **params: Any) -> Any:
    """The ``ModelInferRequest`` tritonclient's ``infer`` / ``async_stream_infer`` send."""
    return _get_inference_request(
        model_name=model,
        inputs=inputs,
        model_version="",
        request_id=request_id,
        outputs=None,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        parameters=params or None,
    )


def parameters(result: grpcclient.InferResult) -> dict[str, Any]:
    """The response's parameters as plain values."""
    params = result.get_response().parameters
    return {
        key: getattr(value, value.WhichOneof("parameter_choice")) for key, value in params.items()
    }


def text_of(result: grpcclient.InferResult) -> str | None:
    """The response's one ``text_output`` element; None when it has no output."""
    output = result.as_numpy("text_output")
    if output is None:
        return None
    assert output.shape == (1,), output.shape
    return bytes(output[0]).decode()


@dataclass
class Answer:
    """One request's responses on a stream, the final one last."""

    responses: list[grpcclient.InferResult] = field(default_factory=list)
    error: InferenceServerException | None = None

    @property
    def texts(self) -> list[str]:
        """Each response's text, the final one's included (a response carries the tokens
        that reached the gateway together; the final one the last of them)."""
        return [text_of(r) or "" for r in self.responses]

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def assert_whole_tokens(self, tokens: list[str]) -> None:
        """The responses' texts are ``tokens`` joined, split only between tokens."""
        assert self.text == "".join(tokens), (self.texts, tokens)
        boundaries = {sum(len(t) for t in tokens[:i]) for i in range(len(tokens) + 1)}
        ends = [sum(len(t) for t in self.texts[: i + 1]) for i in range(len(self.texts))]
        assert set(ends) <= boundaries, (self.texts, tokens)

    @property
    def final(self) -> dict[str, Any]:
        return parameters(self.responses[-1])


FINAL = "triton_final_response"


class Responses:
    """``start_stream``'s callback: every response or error, in arrival order."""

    def __init__(self) -> None:
        self.arrived: queue.Queue[tuple[grpcclient.InferResult | None, Any]] = queue.Queue()

    def __call__(self, result: grpcclient.InferResult | None, error: Any) -> None:
        self.arrived.put((result, error))

    def next(self) -> tuple[grpcclient.InferResult | None, Any]:
        return self.arrived.get(timeout=WAIT_S)

    def answers(self, count: int) -> dict[str, Answer]:
        """Until ``count`` requests have their final response or an error, by request id
        (an error's id: its response's, which names the request)."""
        answers: dict[str, Answer] = {}
        ended = 0
        while ended < count:
            result, error = self.next()
            if error is not None:
                answers.setdefault(f"error-{ended}", Answer()).error = error
                ended += 1
                continue
            assert result is not None
            answer = answers.setdefault(result.get_response().id, Answer())
            answer.responses.append(result)
            ended += bool(parameters(result)[FINAL])
        return answers


def triton_reply(address: str, model: str, prompt: str, max_tokens: int = 12) -> Answer:
    """One streamed reply, as a program written from Triton's documentation asks for it."""
    responses = Responses()
    client = grpcclient.InferenceServerClient(address)
    try:
        client.start_stream(callback=responses)
        client.async_stream_infer(
            model, llm_inputs(prompt, max_tokens, temperature=(0.0, "FP32")), request_id="1"
        )
        (answer,) = responses.answers(1).values()
        client.stop_stream()
    finally:
        client.close()
    assert answer.error is None, answer.error
    return answer

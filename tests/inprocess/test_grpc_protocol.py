"""gateway/apis/oip/grpc/tensors.py against tritonclient's own request and result code, in one
process: the gateway's messages are tritonclient's (Triton's generated stubs from its PyPI
package), so what tritonclient sends is read as it is and what the gateway answers decodes
with tritonclient's ``InferResult``."""

from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from gateway.apis.oip.grpc.protocol import pb
from gateway.apis.oip.grpc.tensors import TokenResponses, read_request, text_response
from gateway.core.errors import BadRequest
from tests.support.triton import FINAL, llm_inputs, parameters, sent, text_of


def test_the_gateway_and_tritonclient_share_one_set_of_messages() -> None:
    assert pb is service_pb2
    assert pb.ModelInferRequest is type(sent(llm_inputs("hi", 1)))


def test_a_request_as_tritonclient_builds_it_is_read_and_answered() -> None:
    inputs = llm_inputs("héllo", 5, temperature=(0.5, "FP32"), seed=(7, "UINT64"))
    llm = read_request(sent(inputs, top_k=3, triton_enable_empty_final_response=True))
    assert (llm.model, llm.id, llm.prompt, llm.empty_final) == ("alpha", "r-1", "héllo", True)
    assert (llm.parameters.max_tokens, llm.parameters.temperature) == (5, 0.5)
    assert (llm.parameters.seed, llm.parameters.top_k) == (7, 3)

    token = grpcclient.InferResult(text_response(llm, llm.model, "wörld", final=False))
    assert text_of(token) == "wörld" and parameters(token) == {FINAL: False}
    final = grpcclient.InferResult(
        text_response(llm, llm.model, None, final=True, finish_reason="length", completion_tokens=5)
    )
    assert text_of(final) is None
    assert parameters(final) == {FINAL: True, "finish_reason": "length", "completion_tokens": 5}
    assert final.get_response().id == "r-1"


def test_a_token_response_written_by_hand_is_the_message_protobuf_writes() -> None:
    llm = read_request(sent(llm_inputs("hi", 5)))
    tokens = TokenResponses(llm, "alpha")
    for text in ("wörld", "", "x" * 300, "\n"):  # 300: a length of two varint bytes
        by_hand = service_pb2.ModelStreamInferResponse.FromString(tokens.token(text))
        by_protobuf = service_pb2.ModelStreamInferResponse(
            infer_response=text_response(llm, "alpha", text, final=False)
        )
        assert by_hand == by_protobuf
        result = grpcclient.InferResult(by_hand.infer_response)
        assert text_of(result) == text and parameters(result) == {FINAL: False}


def test_sampling_parameters_that_are_not_json_are_refused_saying_where() -> None:
    """vLLM's backend takes ``sampling_parameters`` as JSON text in a request parameter."""
    with pytest.raises(BadRequest) as refused:
        read_request(sent(llm_inputs("hi", 5), sampling_parameters='{"temperature": 0.5,'))
    assert refused.value.field == "sampling_parameters"
    assert refused.value.message == (
        "`sampling_parameters` is not valid JSON: it ends before the JSON value does, "
        "at line 1, column 21 (byte 20)"
    )

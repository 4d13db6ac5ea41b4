"""bench.e2e's ``grpc`` path: Triton's ``ModelStreamInfer`` on the gateway's gRPC server, one
call per stream (its one request sent, then its side closed), all calls on one channel as a
gRPC client multiplexes them. Every response but the final one is a token; the final one's
``completion_tokens`` tops the count up when one response carried several (joined tokens)."""

from __future__ import annotations

import asyncio
import struct
import time

import grpc

from bench.loadgen import StreamRecord, TaskStream
from bench.rig import Rig
from gateway.apis.oip.grpc.protocol import pb

METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def stream_request(rig: Rig, max_tokens: int) -> pb.ModelInferRequest:
    """A request as tritonclient sends it: raw little-endian contents, BYTES length-prefixed;
    greedy."""
    prompt = rig.prompt.encode()
    request = pb.ModelInferRequest(model_name=rig.model)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    request.inputs.add(name="temperature", datatype="FP32", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(prompt)) + prompt)
    request.raw_input_contents.append(struct.pack("<i", max_tokens))
    request.raw_input_contents.append(struct.pack("<f", 0.0))
    return request


async def read(call: grpc.aio.StreamStreamCall, record: StreamRecord) -> None:
    try:
        async for response in call:
            now = time.perf_counter()
            if response.error_message:
                record.end(failure=response.error_message)
                return
            parameters = response.infer_response.parameters
            if parameters["triton_final_response"].bool_param:
                record.arrive(now, parameters["completion_tokens"].int64_param)
                record.end(final="done")
                return
            record.arrive(now, None)
        record.end(failure="the stream ended with no final response")
    except grpc.aio.AioRpcError as exc:
        record.end(failure=f"{exc.code().name}: {exc.details()}")


def open_grpc_stream(
    channel: grpc.aio.Channel, request: pb.ModelInferRequest, record: StreamRecord
) -> TaskStream:
    loop = asyncio.get_running_loop()
    record.ready = loop.create_future()
    record.finished = loop.create_future()
    record.submitted_at = time.perf_counter()
    call = channel.stream_stream(
        METHOD,
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )(iter([request]))
    return TaskStream(asyncio.create_task(read(call, record), name="grpc stream"))

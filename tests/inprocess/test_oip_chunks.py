"""The Open Inference Protocol adapter's wire output, built from contract events in this
process: its stream events (gateway/apis/oip/routes.py), byte for byte."""

from __future__ import annotations

from gateway.apis.oip import routes as oip
from gateway.core.walk import Heartbeat, walk
from tests.support.adapter_events import (
    DONE_STOP,
    HELLO,
    KEEP_ALIVE,
    STARTED,
    Indexed,
    data,
    written,
)
from wire import Cancelled, Usage


async def test_oip_stream_one_event_per_step_then_the_finish_reason() -> None:
    events = Indexed(STARTED, HELLO[0], Heartbeat(), DONE_STOP)
    sent = await written(walk(events, oip.OipStream("m", "r1")))
    assert sent == [
        data({"model_name": "smol", "text_output": "Hel", "id": "r1"}),
        KEEP_ALIVE,
        data({"model_name": "smol", "text_output": "", "finish_reason": "stop", "id": "r1"}),
    ]


async def test_oip_stream_without_request_id_or_started_uses_the_path_model() -> None:
    sent = await written(walk(Indexed(HELLO[0], DONE_STOP), oip.OipStream("from-path", None)))
    assert sent == [
        data({"model_name": "from-path", "text_output": "Hel"}),
        data({"model_name": "from-path", "text_output": "", "finish_reason": "stop"}),
    ]


async def test_oip_stream_ending_without_finishing_sends_the_protocols_error() -> None:
    sent = await written(
        walk(Indexed(STARTED, Cancelled("g", "user", Usage(3, 0))), oip.OipStream("m", None))
    )
    assert sent == [data({"error": "the generation was cancelled (user)"})]

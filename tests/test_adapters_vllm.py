"""Each API adapter's own client against the real vLLM engine (SmolLM2 on the CPU): token
ids, logprobs and usage come from the engine; a few short generations, several checks each."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from huggingface_hub import AsyncInferenceClient, InferenceClient

from engine.model import default_model_dir
from tests.support.sse import parse
from tests.support.stack import VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49_152


async def test_openai_sdk_streams_and_answers_with_real_usage_and_logprobs(
    vllm_stack: VllmStack,
) -> None:
    base = f"{vllm_stack.gateway.url}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as sync:
        assert MODEL in [m.id for m in sync.models.list().data]

        chunks = list(
            sync.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Name three colours."}],
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                logprobs=True,
            )
        )
        assert {c.model for c in chunks} == {MODEL}
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip()
        logprobs = [
            entry.logprob
            for c in chunks
            if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
            for entry in c.choices[0].logprobs.content
        ]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens > 5
        assert len(logprobs) == usage.completion_tokens <= 8
        assert all(lp <= 0 for lp in logprobs) and any(lp < 0 for lp in logprobs)

        client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0)
        try:
            prompt = "The capital of France is"
            whole = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0
            )
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True
            )
            streamed = "".join([c.choices[0].text async for c in stream if c.choices])
            # Greedy decoding: the stream and the whole answer are the same text.
            assert whole.choices[0].text == streamed and streamed.strip()
            assert whole.usage is not None and whole.usage.completion_tokens <= 6
            assert whole.choices[0].finish_reason in ("length", "stop")
        finally:
            await client.close()


async def test_huggingface_client_streams_real_token_ids_and_logprobs(
    vllm_stack: VllmStack,
) -> None:
    url = f"{vllm_stack.gateway.url}/generate"
    prompt = "Once upon a time"
    sync = InferenceClient(model=url)  # keep it: its stream closes with it
    events = list(sync.text_generation(prompt, max_new_tokens=8, stream=True, details=True))
    assert 1 <= len(events) <= 8
    assert all(0 <= e.token.id < VOCAB_SIZE for e in events)
    assert all(e.token.logprob <= 0 for e in events)
    last = events[-1]
    assert last.details is not None
    assert last.details.generated_tokens == len(events)
    assert last.details.input_length > 0
    assert last.generated_text == "".join(e.token.text for e in events)

    client = AsyncInferenceClient(model=url)
    try:
        whole = await client.text_generation(prompt, max_new_tokens=8, details=True)
    finally:
        await client.close()
    # TGI decodes greedily by default: the same tokens, whole or streamed.
    assert whole.generated_text == last.generated_text
    assert whole.details is not None
    assert [t.id for t in whole.details.tokens] == [e.token.id for e in events]


async def test_open_inference_protocol_streams_the_same_text_it_answers_whole(
    vllm_stack: VllmStack,
) -> None:
    base = f"{vllm_stack.gateway.url}/v2/models/{MODEL}"
    body = {"text_input": "One, two, three,", "parameters": {"max_tokens": 6, "temperature": 0}}
    async with httpx.AsyncClient(timeout=120) as client:
        ready = await client.get(f"{base}/ready")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        whole = await client.post(f"{base}/generate", json=body)
        assert whole.status_code == 200 and whole.json()["model_name"] == MODEL
        async with client.stream("POST", f"{base}/generate_stream", json=body) as response:
            assert "content-encoding" not in response.headers
            events = [event.json() async for event in parse(response.aiter_lines())]
    assert "".join(e["text_output"] for e in events) == whole.json()["text_output"]
    assert events[-1]["finish_reason"] == whole.json()["finish_reason"]


async def test_sampling_parameters_reach_the_engine(vllm_stack: VllmStack) -> None:
    """vLLM's seeded sampling is deterministic, so each comparison below is too: a seed
    repeats its text, top_k=1 or a tiny top_p turn sampling greedy, and the text changes
    with the temperature and with the seed (for this prompt and these seeds)."""
    client = openai.AsyncOpenAI(
        base_url=f"{vllm_stack.gateway.url}/v1", api_key="unused", max_retries=0
    )

    async def text(**params: object) -> str:
        extra = {"top_k": params.pop("top_k")} if "top_k" in params else None
        answer = await client.completions.create(
            model=MODEL,
            prompt="My favourite animal is",
            max_tokens=32,
            extra_body=extra,
            **params,  # type: ignore[arg-type]
        )
        return answer.choices[0].text

    try:
        greedy = await text(temperature=0)
        sampled = await text(temperature=1.0, seed=1234)
        assert await text(temperature=1.0, seed=1234) == sampled
        assert sampled != greedy  # the temperature (and seed) reached the engine
        assert await text(temperature=1.0, seed=1234, top_k=1) == greedy
        assert await text(temperature=1.0, seed=1234, top_p=1e-6) == greedy
        assert await text(temperature=1.0, seed=4321) != sampled
    finally:
        await client.close()


async def test_fields_left_unset_take_the_models_recommended_sampling(
    vllm_stack: VllmStack,
) -> None:
    """The bundled model's folder recommends its authors' temperature 0.2 and top_p 0.9
    (generation_config.json, engine/model.py): a request that sets neither samples with
    them, as vLLM's own server does, where it sampled at OpenAI's temperature 1 (word
    salad from a 135M model); what a request sets wins. Seeded: deterministic."""
    folder = json.loads((default_model_dir() / "generation_config.json").read_text())
    assert (folder["temperature"], folder["top_p"]) == (0.2, 0.9)
    client = openai.AsyncOpenAI(
        base_url=f"{vllm_stack.gateway.url}/v1", api_key="unused", max_retries=0
    )

    async def text(**params: object) -> str:
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write two sentences about the sea."}],
            max_tokens=40,
            seed=1234,
            **params,  # type: ignore[arg-type]
        )
        return answer.choices[0].message.content or ""

    try:
        unset = await text()
        print(f"\nleft to the model: {unset!r}\nat temperature 1: {await text(temperature=1.0)!r}")
        assert unset == await text(temperature=0.2, top_p=0.9)
        assert unset != await text(temperature=1.0, top_p=1.0)
    finally:
        await client.close()


async def test_vllms_extra_sampling_fields_are_applied_by_the_engine(
    vllm_stack: VllmStack,
) -> None:
    """``extra_body`` fields as clients of ``vllm serve`` send them, applied by vLLM."""
    base = vllm_stack.gateway.url
    prompt = "The capital of France is"
    async with httpx.AsyncClient(timeout=300) as http:
        greedy = await http.post(
            f"{base}/generate",
            json={"inputs": prompt, "parameters": {"max_new_tokens": 6, "details": True}},
        )
    token_ids = [token["id"] for token in greedy.json()["details"]["tokens"]]
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    try:
        stopped = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            extra_body={"stop_token_ids": [token_ids[2]]},
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage is not None and stopped.usage.completion_tokens == 3
        # ignore_eos with min_tokens: exactly max_tokens, whatever the model would say.
        forced = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say yes."}],
            max_tokens=24,
            temperature=0,
            extra_body={
                "ignore_eos": True,
                "min_tokens": 24,
                "min_p": 0.05,
                "repetition_penalty": 1.3,
                "skip_special_tokens": False,
                "spaces_between_special_tokens": False,
            },
        )
        assert forced.usage is not None and forced.usage.completion_tokens == 24
        assert forced.choices[0].finish_reason == "length"
    finally:
        await client.close()

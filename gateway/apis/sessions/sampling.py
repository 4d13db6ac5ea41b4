"""The sampling fields of the gateway's own APIs, declared once: a session message
(``POST /v1/sessions/{id}/messages``) and a WebSocket ``generate`` frame take the same
ones, with the same bounds."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from gateway.core import structured


class SamplingIn(msgspec.Struct, frozen=True, kw_only=True):
    """What a request may ask of the sampling; a field left out takes the gateway's
    default (``GenerationQueue.sampling``)."""

    max_tokens: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    stop: Annotated[list[str], msgspec.Meta(max_length=8)] | None = None
    seed: int | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """No end (of sequence, or at a stop string) before this many tokens (vLLM's field)."""
    ignore_eos: bool = False
    """Go on past the model's end of sequence, to ``max_tokens`` or a stop (vLLM's field)."""
    logprobs: bool = False
    """Each token event carries its tokens' logprobs and own texts."""
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] = 0
    response_format: structured.ResponseFormat | None = None
    structured_outputs: structured.StructuredOutputsIn | None = None
    n: int = 1
    """Replies to sample (``TOKENSPOUT_MAX_CHOICES`` at most): each a generation of the
    session whose events (a socket's frames) give its ``choice``; the first joins the
    history."""

    def given(self) -> frozenset[str]:
        """The sampling fields the request set itself (a conversation's settings fill the
        others it has)."""
        return frozenset(name for name, value in self.asked().items() if value is not None)

    def asked(self) -> dict[str, Any]:
        """The sampling parameters this request sets, for ``GenerationQueue.sampling`` (None:
        the default); its structured-output constraint checked (refused when it is bad)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "seed": self.seed,
            "min_tokens": self.min_tokens or None,
            "ignore_eos": self.ignore_eos or None,
            "logprobs": self.logprobs or None,
            "top_logprobs": self.top_logprobs if self.logprobs else None,
            "structured": structured.constraint(self.response_format, self.structured_outputs),
        }

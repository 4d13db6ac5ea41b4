"""What the synthetic engine answers: its own script (engine/backends/synthetic.py), never
re-derived here."""

from __future__ import annotations

from engine.backends.synthetic import ScriptedToken
from engine.backends.synthetic import scripted_reply as synthetic_tokens

__all__ = ["ScriptedToken", "synthetic_text", "synthetic_tokens"]


def synthetic_text(prompt: str, max_tokens: int) -> str:
    """The synthetic engine's reply to ``prompt`` (``max_tokens`` tokens) as one text."""
    return "".join(token.text for token in synthetic_tokens(prompt, max_tokens))

"""OpenAI's API: chat and (legacy) completions with their hot path, models, vLLM's
tokenize and detokenize, and the Responses API (``responses/``)."""

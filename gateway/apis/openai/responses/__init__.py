"""OpenAI's Responses API: a stored response is a generation in a session of its own."""

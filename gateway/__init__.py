"""tokenspout's gateway: a stateless Litestar app that relays LLM tokens through Redis."""

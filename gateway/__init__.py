"""tokenspout's gateway: a stateless Litestar app that relays LLM tokens through Redis."""

__version__ = "0.1.0"

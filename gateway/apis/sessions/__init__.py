"""tokenspout's own session API: conversations kept in Redis, their event stream over SSE,
and the same over one WebSocket."""

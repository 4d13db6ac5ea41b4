"""The fast tier (``make check``): gateway code driven in this process, no gateway or engine
subprocess; the relay's tests use the session's embedded Redis server."""

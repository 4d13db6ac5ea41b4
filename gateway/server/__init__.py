"""The server: the process that serves the APIs (the app, its HTTP and HTTP/2 transports,
SSE writing, ``--workers N``, metrics and middleware)."""

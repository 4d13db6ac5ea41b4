"""The transports the APIs write: SSE frames and responses, gRPC over HTTP/2."""

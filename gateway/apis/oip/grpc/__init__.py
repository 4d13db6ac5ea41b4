"""The KServe v2 inference service over gRPC: its messages, tensors and methods."""

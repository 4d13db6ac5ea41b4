"""The Open Inference Protocol (KServe v2): ``generate`` and ``generate_stream`` over HTTP,
and the inference service over gRPC (Triton's streaming ``ModelStreamInfer``)."""

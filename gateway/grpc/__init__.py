"""The KServe v2 / Triton gRPC inference service (``inference.GRPCInferenceService``) in the
gateway process: ``server`` (its life), ``service`` (the RPCs over ``GenerationStream``),
``tensors`` (LLM requests and responses as tensors), ``metadata``; ``protocol`` imports the
protocol's messages, Triton's own generated stubs from its PyPI package (tritonclient)."""

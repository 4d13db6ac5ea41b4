"""The KServe v2 / Triton protocol's messages: Triton's own generated stubs, from its PyPI
package (``tritonclient[grpc]``, pinned in pyproject.toml). Nothing is vendored here and
nothing is generated at build time; this module is the one place the gateway imports them.

``pb`` is ``tritonclient.grpc.service_pb2`` (``ModelInferRequest``, ``ModelInferResponse``,
``ModelStreamInferResponse``, ...). tritonclient ships no type hints, so past this boundary
the messages are ``Any`` to mypy (pyproject.toml's ``tritonclient.*`` override).

Sharing tritonclient's modules means one set of ``inference.*`` descriptors in protobuf's
default pool: the gateway, tritonclient's client and anything else importing Triton's stubs
live in one process together.
"""

from __future__ import annotations

from tritonclient.grpc import service_pb2 as pb

__all__ = ["pb"]

"""gRPC status codes for Prism's typed errors, and the exception the ingress raises after setting one.

Kept apart from the ingress on purpose: Serve's gRPC proxy unpickles the exception a replica raises, which imports
the module that defines its class — here that costs milliseconds, where importing the ingress (torch, transformers)
made the first refused gRPC call after start-up take seconds.
"""

from __future__ import annotations

import json

import grpc

from common.errors import PrismError

GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.FAILED_PRECONDITION,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class GrpcAbort(Exception):
    """Raised after setting a status on the gRPC context: Serve turns it into that status for the client."""


def grpc_abort(grpc_context, exc: PrismError | None) -> GrpcAbort:
    """Set ``exc``'s status and OpenAI error body (as details) on the context; returns what to raise."""
    assert exc is not None
    grpc_context.set_code(GRPC_CODES.get(exc.http_status, grpc.StatusCode.INTERNAL))
    grpc_context.set_details(json.dumps(exc.to_body()))
    return GrpcAbort(exc.message)

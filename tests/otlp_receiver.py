"""A real OTLP/HTTP trace receiver for tests: an HTTP server on loopback that decodes each ``POST /v1/traces``
(``ExportTraceServiceRequest``, protobuf, gzip or not) with ``opentelemetry-proto`` and keeps the spans."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict
    service: str


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                receiver._keep(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _keep(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource in request.resource_spans:
                service = next((_value(a.value) for a in resource.resource.attributes if a.key == "service.name"), "")
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        attrs = {a.key: _value(a.value) for a in s.attributes}
                        self.spans.append(
                            ReceivedSpan(
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                                attrs,
                                service,
                            )
                        )

    def trace(self, trace_id: str, until=lambda spans: bool(spans), timeout: float = 30) -> list[ReceivedSpan]:
        """The spans of ``trace_id`` once ``until`` holds for them (or the timeout passes)."""
        deadline = time.time() + timeout
        while True:
            with self.lock:
                found = [s for s in self.spans if s.trace_id == trace_id]
            if until(found) or time.time() > deadline:
                return found
            time.sleep(0.2)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

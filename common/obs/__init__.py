"""Observability without Ray: request traces, the declared metric catalogue, keyed media hashes, request log lines."""

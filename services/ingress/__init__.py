"""The ingress: the OpenAI-compatible HTTP API and the gRPC API in front of every served model's stage chain.

``server`` (the deployment: routes, authentication, entry points) → ``lifecycle`` (one request's life, closed once)
→ ``pipeline`` (plan the request, admit it, issue its chain) → ``call_stream`` (a started call's decode stream,
migration) — with ``kv_reserver`` (KV before prefill), ``failures`` (what a failure becomes), ``body`` (the HTTP
body's bound), ``openai_format`` / ``grpc_errors`` (what goes back on the wire), ``observer`` (metrics and the request
log) and ``retry``.
"""

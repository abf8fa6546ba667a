"""Serve request routers built in the ingress: ``affinity`` (encode and prefill calls to the replica whose cache holds
their media or prompt prefix) and ``pinned`` (a decode call to the replica holding its KV reservation), with
``route_log`` keeping each routing decision for the request's trace."""

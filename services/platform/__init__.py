"""What Prism runs inside Ray's own processes and on Ray's machinery: ``metrics`` (through Ray's exporter), the
``autoscaling`` policy (in the Serve controller), the front door (``front_door``: HAProxy in front of the ingress
replicas, launched through ``haproxy_launch``) and its body guard (``proxy_guard``), the ``loopback`` binds of
``make serve``, and ``memory`` (giving freed heap back after a refused body)."""

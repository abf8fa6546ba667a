"""Baseline servers the benchmark starts on 127.0.0.1: the monolith and the naive transformers server."""

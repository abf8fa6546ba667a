"""Offline video batches without Ray: manifest reading, per-row work on the shared stage code, resumable output."""

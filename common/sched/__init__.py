"""Scheduling: admission by resource vector, encoder batching."""

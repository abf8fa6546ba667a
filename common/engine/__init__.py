"""Engines that run many requests at once over shared state (the paged KV pool)."""

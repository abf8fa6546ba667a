"""KV cache side of the engine: fixed-size blocks, export from and import into transformers caches."""

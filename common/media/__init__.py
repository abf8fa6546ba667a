"""Media handling: safe fetch, sniffing, decoding, limits and digests (the media stage's Ray-free core)."""

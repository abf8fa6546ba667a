"""Each token id's bytes, as the tokenizer's decoder writes them — what OpenAI's ``logprobs`` report as a token's
``bytes`` (a token may be part of a UTF-8 character; its text alone would lose that).

Byte-level BPE (GPT-2's scheme: the built models, Qwen2) spells each byte as one printable character of a fixed table;
SentencePiece (Llama's) writes a space as ``▁`` and a byte it has no piece for as ``<0xNN>``. Added tokens (special or
not) are their own text. One :class:`TokenBytes` per tokenizer, filled as tokens are asked for.
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the other 68 bytes (controls,
    space, DEL, NBSP, soft hyphen …) for the characters from U+0100 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in kept}
    moved = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    return table


class TokenBytes:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self._table = _byte_level_table() if self._byte_level else {}
        self._added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._known.get(token_id)
        if found is None:
            found = self._known[token_id] = self._bytes(token_id)
        return found

    def text(self, token_id: int) -> str:
        """The token as text (a partial UTF-8 character becomes U+FFFD, as OpenAI's ``token`` field has it)."""
        return self(token_id).decode("utf-8", errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            return bytes(self._table[c] for c in piece if c in self._table)
        byte = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(byte[1], 16)]) if byte else piece.replace("▁", " ").encode()

"""Incremental detokenization: the text a streaming client sees, token by token, at O(1) decode work per token.

Decoding each token on its own is wrong for byte-level BPE (one character can span tokens; a piece's leading space
can depend on its neighbour), and decoding the whole output again for every token is O(n²) on the ingress's event
loop. So, as vLLM and TGI do, each push decodes a short window twice — the tokens since ``prefix`` (a few tokens
already turned into text, kept for context) without and with the unread ones — and appends the difference. While
that difference ends in an incomplete UTF-8 sequence (U+FFFD) the tokens stay unread and the window grows until the
character completes.

What a push returns is *final* text only: the tail that could still become a stop string (the longest stop string
minus one character) is held back until the next token or :meth:`Detokenizer.finish`; once a stop string appears the
text is cut before it and nothing more is returned. Concatenating every push and the finish gives exactly
:func:`common.stages.stops.visible_text` of the same ids (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        """Decoded text of ``ids[:read]``, cut before the first stop string once one appeared."""
        self.stopped = False
        self._prefix = 0
        self._read = 0
        self._scanned = 0
        self._sent = 0

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that became final."""
        self.ids.append(token_id)
        if not self.stopped:
            self._decode(force=False)
        return self._emit(len(self.text) if self.stopped else len(self.text) - max(0, self._longest - 1))

    def finish(self) -> str:
        """The rest of the text (an incomplete trailing character is decoded as U+FFFD, as a full decode would)."""
        if not self.stopped:
            self._decode(force=True)
        return self._emit(len(self.text))

    def _decode(self, force: bool) -> None:
        if self._read == len(self.ids):
            return
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) > len(before) and (force or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            self._cut_at_stop()
        elif len(after) <= len(before) and not after.endswith("\ufffd"):
            self._read = len(self.ids)  # tokens with no text (special tokens): nothing to wait for

    def _cut_at_stop(self) -> None:
        if not self.stop:
            return
        start = max(0, self._scanned - self._longest + 1)  # a stop string may straddle the last scan's end
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True
        self._scanned = len(self.text)

    def _emit(self, upto: int) -> str:
        upto = min(upto, len(self.text))
        if upto <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent : upto], upto
        return delta

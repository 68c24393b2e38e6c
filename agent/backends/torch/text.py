"""Token ids to streamed text: whole characters only, and never a byte of a stop string."""

from __future__ import annotations

from typing import Any


class Text:
    """Incremental detokenisation of one request. Decoding each new token alone would break
    characters split across tokens and spaces some tokenizers only render in context, so each
    step decodes a short window ending at the new tokens and keeps what it adds to the window's
    older part. Text that could be the start of a stop string is held back until it is not."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.text = ""  # everything decoded so far
        self.sent = 0  # how much of it went out
        self._prefix = 0  # the window: tokens[_prefix:_read] are decoded, tokens[_read:] not yet
        self._read = 0

    @property
    def count(self) -> int:
        return len(self.tokens)

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def add(self, tokens: list[int]) -> tuple[str, bool]:
        """The new text that may go out now, and whether a stop string was reached (the text ends
        before it; the caller stops the request)."""
        self.tokens.extend(tokens)
        if len(self.tokens) > self._read:
            before = self._decode(self.tokens[self._prefix:self._read])
            after = self._decode(self.tokens[self._prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self._prefix, self._read = self._read, len(self.tokens)
        return self._release()

    def _release(self) -> tuple[str, bool]:
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            piece = self.text[self.sent:min(hits)]
            self.sent = len(self.text)
            return piece, True
        end = len(self.text)
        for s in self.stop:  # the longest tail that begins some stop string waits
            for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                if self.text.endswith(s[:n]):
                    end = min(end, len(self.text) - n)
                    break
        piece = self.text[self.sent:end]
        self.sent = end
        return piece, False

    def flush(self) -> str:
        """What is left at the end: held-back text and an incomplete last character, as it is."""
        tail = self._decode(self.tokens[self._prefix:])
        head = self._decode(self.tokens[self._prefix:self._read])
        if len(tail) > len(head):
            self.text += tail[len(head):]
            self._prefix = self._read = len(self.tokens)
        piece = self.text[self.sent:]
        self.sent = len(self.text)
        return piece

"""A reply's text as its tokens arrive, decoded a few tokens at a time (vLLM's and TGI's incremental
detokenization).

Design choices:

* **Decode the tail, not the reply**: each new token decodes two short slices, the tokens since the last
  emitted piece with and without the new one, from a context of the piece before them (``prefix``), so a token
  costs the same at the 4,000th as at the first; decoding the whole reply after every token (what the server did
  before) costs the reply's length a token, quadratic in it.
* **Only whole characters**: a character spread over several byte tokens decodes to U+FFFD until its last byte
  arrives, so text ending in U+FFFD is held back until the next token decides; the emitted pieces are never taken
  back. :meth:`IncrementalText.flush` gives what is left when the reply ends (a character cut short shows as
  U+FFFD there, as decoding the whole reply shows it).
* **The same text as decoding the whole reply**: a slice begins where the text before it ended on a whole
  character, where a UTF-8 decoder starts afresh, so the pieces add up to ``decode(ids)`` (tested for every
  tokenizer kind, on byte-split characters and invalid bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalText", "completed_pieces", "first_stop"]

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class IncrementalText:
    """The text of a growing token list.

    Args:
        decode: ids -> text (a tokenizer's ``decode``, or the chat engine's ``display``), prefix-consistent at
            whole characters: ``decode(a + b) == decode(a) + decode(b)`` where ``decode(a)`` ends on one.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""  # the emitted text: decode(ids[:read])
        self.prefix = 0  # ids[prefix:read]: the last emitted piece's tokens, the context the next slice starts from
        self.read = 0  # ids[read:]: the tokens whose text is held back

    def add(self, token: int) -> str:
        """Append ``token``; return the text it completes ("" while a character is still incomplete)."""
        self.ids.append(token)
        return self._advance(final=False)

    def completes_stop(self, new: str, stops: Sequence[str]) -> bool:
        """Whether ``new``, the last piece :meth:`add` returned, completes one of ``stops`` in the text: one that ends
        in it (looked for only where it can, so a token costs the same however long the text)."""
        return bool(new) and first_stop(self.text, stops, len(self.text) - len(new)) is not None

    def flush(self) -> str:
        """The text still held back (the reply ended: an incomplete character shows as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        if len(now) <= len(before) or (now.endswith(REPLACEMENT) and not final):
            return ""
        piece = now[len(before) :]
        self.text += piece
        self.prefix, self.read = self.read, len(self.ids)
        return piece


def first_stop(text: str, stops: Sequence[str], after: int = 0) -> tuple[int, int] | None:
    """Where the first of ``stops`` that ends past ``text``'s first ``after`` characters begins and ends (None: none
    does); of two that begin at one place, the one listed first (vLLM looks for them in the request's order).
    ``after`` > 0 passes over the text a request's first ``min_tokens`` tokens wrote, where vLLM looks for no stop
    string; a search begins only where such a stop string can."""
    found = [
        (i, n, i + len(stop))
        for n, stop in enumerate(stops)
        if (i := text.find(stop, max(0, after - len(stop) + 1))) >= 0
    ]
    if not found:
        return None
    start, _, end = min(found)
    return start, end


def completed_pieces(decode: Callable[[list[int]], str], ids: list[int]) -> list[str]:
    """The text each of ``ids`` completes, as :class:`IncrementalText` emits it ("" for a split character's first
    bytes; what is held back at the end goes to the last): the pieces join to ``decode(ids)``."""
    text = IncrementalText(decode)
    pieces = [text.add(token) for token in ids]
    if pieces:
        pieces[-1] += text.flush()
    return pieces

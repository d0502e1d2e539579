"""Shared by the serving tests: a sampler that fails mid-generation."""

from __future__ import annotations

import pytest


def fail_at_the_second_draw(monkeypatch: pytest.MonkeyPatch, tokenizer) -> None:
    """The batcher's sampler patched for one request: its first token is 'h' (a token with text of its own, so a
    stream has begun), the second draw raises "device lost" (on two lines)."""
    import lapheads.apps.batching as batching  # where a reply's tokens are sampled

    calls, first = [], tokenizer.encode("h")

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("device lost\nsecond line")
        return first

    monkeypatch.setattr(batching, "sample_rows", failing)

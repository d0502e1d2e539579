"""Incremental detokenization (lapheads.apps.detokenize): the pieces add up to the whole reply's text, characters
split over byte tokens come out whole, and a token decodes a few tokens, not the reply."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lapheads.apps.detokenize import IncrementalText
from lapheads.data.tokenizers import Tokenizer, train_bpe

CORPUS = ["Speak, speak. First Citizen: before we proceed any further.\n" * 20, "café naïve 東京 🌍\n" * 5]


@pytest.fixture(scope="module")
def tokenizers():
    return {"char": Tokenizer.char("".join(CORPUS)), "bpe": train_bpe(CORPUS, 400), "gpt2": Tokenizer.gpt2()}


def _pieces(decode, ids: list[int]) -> list[str]:
    text = IncrementalText(decode)
    return [text.add(token) for token in ids] + [text.flush()]


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=60), data=st.data())
def test_the_pieces_add_up_to_the_whole_text_and_hold_back_only_incomplete_characters(tokenizers, text, data):
    """Any text (emoji and CJK split over byte tokens), and any ids at all (invalid byte runs, cut characters,
    special tokens): the pieces joined are decode(ids), and no piece but the last ends in an incomplete
    character's U+FFFD unless the whole text has one there."""
    for tokenizer in tokenizers.values():
        for ids in (tokenizer.encode(text), data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=30))):
            pieces = _pieces(tokenizer.decode, ids)
            whole = tokenizer.decode(ids)
            assert "".join(pieces) == whole
            emitted = ""
            for n, piece in enumerate(pieces[:-1], 1):
                emitted += piece
                assert whole.startswith(emitted)
                if piece.endswith("\ufffd"):  # only where the text up to this token is final there
                    assert tokenizer.decode(ids[:n]) == emitted and whole[len(emitted) - 1] == "\ufffd"


def test_a_character_split_over_byte_tokens_comes_out_whole(tokenizers):
    char = tokenizers["char"]
    ids = char.encode("a€b")  # '€' is not in the corpus: three byte tokens
    assert len(ids) == 5
    assert _pieces(char.decode, ids) == ["a", "", "", "€", "b", ""]
    assert _pieces(char.decode, ids[:3]) == ["a", "", "", "\ufffd"]  # cut short: shown as decoding shows it


def test_each_token_decodes_a_few_tokens_not_the_reply(tokenizers):
    """A 3,000-token reply: every decode call sees at most 3 tokens (the quadratic cost was the whole reply a
    token)."""
    bpe = tokenizers["bpe"]
    ids = bpe.encode(CORPUS[0] * 20)[:3000]
    seen: list[int] = []

    def decode(slice_: list[int]) -> str:
        seen.append(len(slice_))
        return bpe.decode(slice_)

    assert "".join(_pieces(decode, ids)) == bpe.decode(ids) and len(ids) == 3000
    assert max(seen) <= 3 and len(seen) == 2 * len(ids) + 2


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="abc€ ", max_size=40), stops=st.lists(st.text(alphabet="abc€ ", min_size=1, max_size=4),
                                                                   max_size=3))  # fmt: skip
def test_a_stop_string_is_found_at_the_token_that_completes_it(tokenizers, text, stops):
    """completes_stop, which looks only where the new text can complete a stop string, says True first at the
    token after which the whole text holds one, as searching the whole text after every token did."""
    char = tokenizers["char"]
    incremental = IncrementalText(char.decode)
    for token in char.encode(text):
        found = incremental.completes_stop(incremental.add(token), stops)
        assert found == any(stop in incremental.text for stop in stops)  # none was there before: the loop ends at one
        if found:
            break

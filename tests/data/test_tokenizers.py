"""Tokenizers: GPT-2 ids, unicode round trips, save/load, byte counts, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lapheads.data.tokenizers import SPECIAL_TOKENS, Tokenizer, TokenizerError, load_tokenizer, train_bpe

CORPUS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20,
    "Numbers 12345 and 2026; unicode: café, naïve, 東京, emoji 🌍.\n" * 10,
]


@pytest.fixture(scope="module")
def tokenizers():
    return {"char": Tokenizer.char("".join(CORPUS)), "bpe": train_bpe(CORPUS, 400), "gpt2": Tokenizer.gpt2()}


def test_gpt2_ids_equal_openais():
    gpt2 = Tokenizer.gpt2()
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("hello world") == [31373, 995]
    assert gpt2.bos_id == 50256 and gpt2.decode([50256]) == "<|endoftext|>"
    assert gpt2.encode("<|endoftext|>") != [50256]  # special strings in text stay text
    assert gpt2.special_id("<|assistant_start|>") >= 50257


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80))
def test_arbitrary_unicode_round_trips(tokenizers, text):
    for tokenizer in tokenizers.values():
        assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_save_load_and_byte_counts(tokenizers, kind, tmp_path):
    tokenizer = tokenizers[kind]
    loaded = load_tokenizer(tokenizer.save(tmp_path / kind))
    text = CORPUS[1] + CORPUS[0][:200]
    assert loaded.encode(text, bos=True) == tokenizer.encode(text, bos=True)
    assert loaded.vocab_size == tokenizer.vocab_size
    ids = tokenizer.encode(text, bos=True)
    assert ids[0] == tokenizer.bos_id
    assert int(tokenizer.token_bytes()[ids].sum()) == len(text.encode("utf-8"))  # BOS counts 0 bytes


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_special_ids_are_the_control_tokens_and_no_text(tokenizers, kind):
    """What a server leaves out of a reply that ends on one (vLLM's skip_special_tokens): BOS and the chat tokens,
    exactly the tokens that stand for no bytes of text."""
    tokenizer = tokenizers[kind]
    names = [tokenizer.bos, *SPECIAL_TOKENS[1:]]
    assert {tokenizer.special_id(name) for name in names} == tokenizer.special_ids
    assert tokenizer.special_ids == {i for i, n in enumerate(tokenizer.token_bytes().tolist()) if n == 0}


def test_bpe_learns_merges_and_keeps_special_tokens(tokenizers):
    bpe = tokenizers["bpe"]
    assert len(bpe.encode(CORPUS[0])) < len(CORPUS[0].encode("utf-8")) / 2
    assert [bpe.special_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))


def test_bad_input(tmp_path, tokenizers):
    with pytest.raises(TokenizerError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "lapheads_tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="is corrupt"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="BPE vocab_size 100 is too small; allowed: >= 265"):
        train_bpe(CORPUS, 100)
    with pytest.raises(TokenizerError, match="unknown special token"):
        tokenizers["char"].special_id("<|nope|>")
    with pytest.raises(TokenizerError, match="GPT-2 BPE file .* is missing"):
        Tokenizer.gpt2(tmp_path)


def _nanochat_encoding():
    """A small tiktoken Encoding shaped like nanochat's: byte ranks, a few merges, nanochat's special tokens."""
    import tiktoken

    from lapheads.data.tokenizers import SPECIAL_TOKENS, SPLIT_PATTERN

    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b"th", b"the", b"he", b" t"):
        ranks[merge] = len(ranks)
    specials = {token: len(ranks) + i for i, token in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(
        name="nanochat-test", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )


def test_nanochats_pickled_tokenizer_loads_without_running_code_and_saves_as_json(tmp_path):
    import os
    import pickle

    from lapheads.data.tokenizers import Tokenizer, TokenizerError, load_tokenizer

    encoding = _nanochat_encoding()
    (tmp_path / "tokenizer.pkl").write_bytes(pickle.dumps(encoding))
    tokenizer = Tokenizer.nanochat(tmp_path)
    text = "the theme <|bos|> of them, naïve"
    ids = tokenizer.encode(text, bos=True)
    assert ids[0] == tokenizer.bos_id == encoding.encode_single_token("<|bos|>")
    assert ids[1:] == encoding.encode_ordinary(text) and tokenizer.decode(ids[1:]) == text
    assert tokenizer.special_id("<|assistant_end|>") == encoding.encode_single_token("<|assistant_end|>")
    counts = tokenizer.token_bytes()
    assert counts[tokenizer.bos_id] == 0 and counts[ord("a")] == 1 and counts[256 + 1] == 3  # b"the"
    assert tokenizer.special_ids == {i for i, n in enumerate(counts.tolist()) if n == 0} != set()
    again = load_tokenizer(tokenizer.save(tmp_path / "saved"))
    assert again.encode(text) == tokenizer.encode(text) and again.vocab_size == tokenizer.vocab_size

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "tokenizer.pkl").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(TokenizerError, match="refused to load posix.system"):
        Tokenizer.nanochat(tmp_path / "evil")
    assert not (tmp_path / "ran").exists()
    # an Encoding whose state names a registered encoding would import tiktoken_ext plugins and download: refused
    (tmp_path / "named").mkdir()
    (tmp_path / "named" / "tokenizer.pkl").write_bytes(
        b"\x80\x02ctiktoken.core\nEncoding\nq\x00)\x81q\x01X\x04\x00\x00\x00gpt2q\x02b."
    )
    with pytest.raises(TokenizerError, match="state is a str .*allowed: its data"):
        Tokenizer.nanochat(tmp_path / "named")


def test_a_crafted_tokenizer_file_is_one_line_even_when_the_library_panics(tmp_path, tokenizers, monkeypatch):
    """tokenizers is Rust: a regex it cannot build is an Exception, a panic a BaseException (pyo3's PanicException);
    both are one TokenizerError naming the file."""
    import json

    import tokenizers as hf

    tokenizers["bpe"].save(tmp_path / "tok")
    state = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    state["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": "a{99999999}"}
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(state))
    with pytest.raises(TokenizerError, match=r"tokenizer.json is missing or corrupt: .*too big number"):
        load_tokenizer(tmp_path / "tok")

    class PanicException(BaseException):  # what pyo3 raises when Rust code panics
        pass

    def panic(path):
        raise PanicException("called `Result::unwrap()` on an `Err` value")

    monkeypatch.setattr(hf.Tokenizer, "from_file", panic)
    with pytest.raises(TokenizerError, match=r"is missing or corrupt: called `Result::unwrap\(\)`"):
        load_tokenizer(tmp_path / "tok")


def test_a_split_regex_that_backtracks_past_its_limit_is_refused_on_load_and_one_line_on_encode(tmp_path, tokenizers):
    """Onig panics ("retry-limit-in-match over") on a catastrophic split pattern: the load's probe text meets it
    and refuses the file by name; a panic on other text is one TokenizerError too (serve then answers JSON)."""
    import json

    tokenizers["bpe"].save(tmp_path / "tok")
    state = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    state["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": "(a+)+b"}
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(state))
    with pytest.raises(TokenizerError, match=r"tok: the bpe tokenizer failed on its input \(.*retry-limit") as err:
        load_tokenizer(tmp_path / "tok")
    assert "\n" not in str(err.value)
    import tokenizers as hf

    backend = hf.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    crafted = Tokenizer("bpe", backend)
    with pytest.raises(TokenizerError, match="a backtracking split regex"):
        crafted.encode("a" * 50)
    with pytest.raises(TokenizerError, match="a backtracking split regex"):
        crafted.encode_batch(["fine", "a" * 50])


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2", "nanochat"])
def test_each_tokens_bytes_join_to_the_texts_utf8(tokenizers, kind, tmp_path):
    """piece_bytes: what OpenAI's logprobs report as a token's bytes; a split character's byte tokens each have
    their own byte (decode shows each alone as U+FFFD), and a special token its name."""
    import pickle

    if kind == "nanochat":
        (tmp_path / "tokenizer.pkl").write_bytes(pickle.dumps(_nanochat_encoding()))
        tokenizer = Tokenizer.nanochat(tmp_path)
    else:
        tokenizer = tokenizers[kind]
    text = "naïve 東京 🌍 € them"
    assert b"".join(tokenizer.piece_bytes(i) for i in tokenizer.encode(text)) == text.encode("utf-8")
    assert tokenizer.piece_bytes(tokenizer.bos_id) == tokenizer.bos.encode("utf-8")

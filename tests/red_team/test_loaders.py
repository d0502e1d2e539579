"""Red team, loaders (issue 28): corrupt files in their true on-disk formats (IDX, CIFAR pickles, safetensors,
tokenizers, JSON) and code hidden in pickles are one-line lapheads errors; nothing runs, nothing of the user's is
changed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


class Payload:
    """A pickle that would touch ``marker`` when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


PAYLOAD = object()  # in a loader case: a pickled Payload that would touch the case's marker


def _idx(path: Path, header: bytes, body: bytes = b"") -> Path:
    path.write_bytes(header + body)
    return path


def _cifar(root: Path, batch: dict | bytes | None = None, name: str = "test_batch") -> Path:
    import pickle

    import numpy as np

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for file in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, 10).tolist()}
        (folder / file).write_bytes(pickle.dumps(entry))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"c{i}" for i in range(10)]}))
    if batch is not None:
        (folder / name).write_bytes(batch if isinstance(batch, bytes) else pickle.dumps(batch))
    return root


def _weights(path: Path, tensors: dict | bytes) -> Path:
    from safetensors.torch import save_file

    if isinstance(tensors, bytes):
        path.write_bytes(tensors)
    else:
        save_file(tensors, str(path))
    return path


def _loader_cases():
    import pickle

    import numpy as np
    import torch

    from lapheads.data.images import build_image_data, read_idx
    from lapheads.data.tokenizers import Tokenizer, load_tokenizer
    from lapheads.runs import load_weights
    from lapheads.runs.directory import read_jsonl

    good = {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}
    size = (3).to_bytes(4, "big")

    # each setup writes its files into tmp (a PAYLOAD value becomes a pickle that would touch the marker) and
    # returns the call that must refuse them
    def weights(tensors):
        def setup(tmp, marker):
            path = _weights(tmp / "model.safetensors", tensors)
            return lambda: load_weights(torch.nn.Linear(3, 2), path)

        return setup

    def cifar(batch, name="test_batch"):
        def setup(tmp, marker):
            if isinstance(batch, dict):
                filled = {key: Payload(marker) if value is PAYLOAD else value for key, value in batch.items()}
            else:
                filled = batch
            _cifar(tmp, filled, name)
            return lambda: build_image_data("cifar10", str(tmp), 32)

        return setup

    def idx(header, body=b"", name="x-idx1-ubyte"):
        def setup(tmp, marker):
            path = _idx(tmp / name, header, body)
            return lambda: read_idx(path)

        return setup

    def tokenizer(files: dict[str, bytes | object], nanochat: bool = False):
        def setup(tmp, marker):
            for name, data in files.items():
                (tmp / name).write_bytes(pickle.dumps(Payload(marker)) if data is PAYLOAD else data)
            return (lambda: Tokenizer.nanochat(tmp)) if nanochat else (lambda: load_tokenizer(tmp))

        return setup

    def jsonl(text):
        def setup(tmp, marker):
            (tmp / "metrics.jsonl").write_text(text)
            return lambda: read_jsonl(tmp / "metrics.jsonl")

        return setup

    def call(fn):
        return lambda tmp, marker: lambda: fn(tmp)

    pixels = np.zeros((10, 3072), dtype=np.uint8)
    state = good["weight"]
    cases = {
        "idx: not gzip": (idx(b"plain", name="x-idx1-ubyte.gz"), "cannot read"),
        "idx: bad magic": (idx(b"\1\2\3\4" + size), "bad magic 01020304"),
        "idx: an empty file": (idx(b""), "not an idx file"),
        "idx: float data": (idx(bytes([0, 0, 0x0D, 1]) + size, b"\0" * 12), "bad magic 00000d01"),
        "idx: truncated": (idx(bytes([0, 0, 8, 1]) + size, b"\0"), "truncated or corrupt"),
        "idx: too long": (idx(bytes([0, 0, 8, 1]) + size, b"\0" * 9), "truncated or corrupt"),
        "idx: a folder": (call(read_idx), "cannot read"),
        "cifar: garbage batch": (cifar(b"garbage"), "cifar10 not found or corrupt"),
        "cifar: code in a batch": (cifar({"data": PAYLOAD, "labels": [0]}), "refused to load posix.system"),
        "cifar: code in the meta": (cifar({"label_names": PAYLOAD}, "batches.meta"), "refused to load posix.system"),
        "cifar: label 10": (cifar({"data": pixels, "labels": [0] * 9 + [10]}), "label 10 of image 9"),
        "cifar: label -1": (cifar({"data": pixels, "labels": [0] * 9 + [-1]}), "label -1 of image 9"),
        "cifar: a label string": (cifar({"data": pixels, "labels": [0] * 9 + ["cat"]}), "label 'cat' of image 9"),
        "cifar: a label bool": (cifar({"data": pixels, "labels": [0] * 9 + [True]}), "label True of image 9"),
        "cifar: a label float": (cifar({"data": pixels, "labels": [0] * 9 + [1.5]}), "label 1.5 of image 9"),
        "cifar: pixels not whole images": (cifar({"data": pixels[:, :3000], "labels": [0] * 10}), "not a whole number"),
        "cifar: fewer labels than images": (cifar({"data": pixels, "labels": [0] * 9}), "10 images but 9 labels"),
        "cifar: no labels": (cifar({"data": pixels}), "not found or corrupt"),
        "cifar: a list, not a dict": (cifar([1, 2, 3]), "not found or corrupt"),
        "cifar: missing": (call(lambda tmp: build_image_data("cifar10", str(tmp), 32)), "not found or corrupt"),
        "fashion-mnist: a root without it": (
            call(lambda tmp: build_image_data("fashion-mnist", str(tmp), 28)),
            "Fashion-MNIST not found",
        ),
        "weights: int8": (weights({**good, "weight": state.to(torch.int8)}), "file torch.int8 vs model torch.float32"),
        "weights: bool": (weights({**good, "weight": state.bool()}), "file torch.bool"),
        "weights: NaN": (weights({**good, "weight": state.clone().fill_(float("nan"))}), "NaN or inf"),
        "weights: inf": (weights({**good, "weight": state.clone().fill_(float("inf"))}), "NaN or inf"),
        "weights: a wrong shape": (weights({**good, "weight": torch.zeros(2, 4)}), "file (2, 4) vs model (2, 3)"),
        "weights: a missing tensor": (weights({"weight": state}), "missing ['bias']"),
        "weights: an extra tensor": (weights({**good, "extra": torch.zeros(1)}), "unexpected ['extra']"),
        "weights: garbage": (weights(b"\x10" + b"\0" * 7 + b"{}garbage"), "not a valid safetensors file"),
        "weights: a pickle": (weights(pickle.dumps({"weight": 1})), "not a valid safetensors file"),
        "weights: truncated": (weights(b"\x40" + b"\0" * 7 + b'{"weight": {"dtype": "F32"'), "not a valid"),
        "weights: missing": (
            call(lambda tmp: load_weights(torch.nn.Linear(3, 2), tmp / "none.safetensors")),
            "is missing",
        ),
        "tokenizer: none": (tokenizer({}), "holds no tokenizer"),
        "tokenizer: corrupt JSON": (tokenizer({"lapheads_tokenizer.json": b"{not json"}), "is corrupt"),
        "tokenizer: code in tokenizer.pkl": (
            tokenizer({"tokenizer.pkl": PAYLOAD}, True),
            "refused to load posix.system",
        ),
        "tokenizer: an encoding by name": (
            tokenizer(
                {"tokenizer.pkl": b"\x80\x02ctiktoken.core\nEncoding\nq\x00)\x81q\x01X\x04\x00\x00\x00gpt2q\x02b."},
                True,
            ),
            "allowed: its data",
        ),
        "tokenizer: not a pickle": (tokenizer({"tokenizer.pkl": b"garbage"}, True), "tokenizer"),
        "metrics.jsonl: a corrupt line before the last": (jsonl('{"a": 1}\n{torn\n{"b": 2}\n'), "line 2 is corrupt"),
    }
    return cases


LOADERS = _loader_cases()


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_loaders(name, tmp_path):
    from lapheads.errors import LapheadsError

    setup, says = LOADERS[name]
    marker, work = tmp_path / "ran", tmp_path / "work"
    work.mkdir()
    call = setup(work, marker)
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    with pytest.raises(LapheadsError) as info:
        call()
    message = str(info.value)
    assert says in message and "\n" not in message, (name, message)
    assert not marker.exists()
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == before  # nothing rewritten or removed


def test_a_gzip_bomb_idx_file_is_refused_without_being_decompressed_whole(tmp_path):
    """Issue 60: an idx.gz was decompressed whole before its header was read. 512 MiB of zeros compress to ~0.5 MB; the
    header says 8 values, so the reader stops one byte past them."""
    import gzip
    import resource
    import time

    from lapheads.data.images import DataError, read_idx

    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    chunk = b"\0" * 2**24
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(bytes([0, 0, 8, 1]) + (8).to_bytes(4, "big"))
        for _ in range(32):  # 512 MiB
            f.write(chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.monotonic()
    with pytest.raises(DataError, match=r"header says \[8\] \(8 values\), file holds more than 8"):
        read_idx(path)
    assert time.monotonic() - began < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: nothing near 512 MiB
    huge = tmp_path / "huge-idx3-ubyte"  # a header naming more data than any machine here holds
    huge.write_bytes(bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in (2**31, 2**20, 2**20)))
    with pytest.raises(DataError, match="more than this machine's memory holds"):
        read_idx(huge)

"""No code runs from any file lapheads reads: pickled data batches, pretrained weights, checkpoints."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lapheads import create_vit
from lapheads.errors import CheckpointError
from lapheads.io import load_tensor_file, restricted_unpickle


class Payload:
    """A pickle that runs a shell command when loaded by a plain unpickler."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_restricted_unpickle_reads_numpy_data_and_refuses_code(tmp_path):
    data = {"data": np.arange(12, dtype=np.uint8).reshape(3, 4), "labels": [1, 2, 3], b"name": "batch 1"}
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = restricted_unpickle(io.BytesIO(pickle.dumps(data, protocol=protocol)))
        assert np.array_equal(back["data"], data["data"]) and back["labels"] == [1, 2, 3]
    marker = tmp_path / "ran"
    evil = pickle.dumps({"data": Payload(marker)})
    with pytest.raises(pickle.UnpicklingError, match="refused to load posix.system"):
        restricted_unpickle(io.BytesIO(evil))
    assert not marker.exists()
    pickle.loads(evil)  # the same bytes do run under a plain unpickler: the test's payload is real
    assert marker.exists()


def test_load_tensor_file_reads_safetensors_and_weights_only_pth(tmp_path):
    state = {"w": torch.randn(3, 2)}
    save_file(state, str(tmp_path / "m.safetensors"))
    torch.save(state, tmp_path / "m.pth")
    for name in ("m.safetensors", "m.pth"):
        assert torch.equal(load_tensor_file(tmp_path / name)["w"], state["w"])


@pytest.mark.parametrize("name", ["evil.pth", "evil.bin", "evil.safetensors"])
def test_load_tensor_file_refuses_a_pickle_with_code(tmp_path, name):
    marker = tmp_path / "ran"
    (tmp_path / name).write_bytes(pickle.dumps({"w": Payload(marker)}))
    with pytest.raises(CheckpointError, match="never runs code|not a valid safetensors"):
        load_tensor_file(tmp_path / name)
    assert not marker.exists()


def test_create_vit_pretrained_file_loads_and_refuses_code_in_one_line(tmp_path):
    kwargs = dict(img_size=16, patch_size=8, embed_dim=24, depth=1, num_heads=2, num_classes=3)
    reference = create_vit("vit_small_patch16_224", 0, **kwargs)
    torch.save(reference.state_dict(), tmp_path / "ok.pth")
    model = create_vit("vit_small_patch16_224", 1, pretrained_file=str(tmp_path / "ok.pth"), **kwargs)
    assert torch.equal(model.blocks[0].attn.qkv.weight, reference.blocks[0].attn.qkv.weight)
    marker = tmp_path / "ran"
    (tmp_path / "evil.pth").write_bytes(pickle.dumps({"w": Payload(marker)}))
    with pytest.raises(CheckpointError) as info:
        create_vit("vit_small_patch16_224", 1, pretrained_file=str(tmp_path / "evil.pth"), **kwargs)
    assert "evil.pth" in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="does not exist"):
        create_vit("vit_small_patch16_224", 1, pretrained_file=str(tmp_path / "none.pth"), **kwargs)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda t: t.to(torch.int8), "dtype of .*: file torch.int8 vs model torch.float32"),
        (lambda t: t.bool(), "dtype of .*: file torch.bool"),
        (lambda t: t.clone().fill_(float("nan")), "holds NaN or inf values"),
        (lambda t: t.clone().index_fill_(0, torch.tensor([0]), float("inf")), "holds NaN or inf values"),
        (  # finite in the file, inf once cast to the model's float32
            lambda t: t.double().index_fill_(0, torch.tensor([0]), 1e300),
            r"0.weight holds values beyond torch.float32's range \(largest 1e\+300\); allowed: values that stay finite",
        ),
    ],
    ids=["int8", "bool", "nan", "inf", "float64-1e300"],
)
def test_weights_of_a_non_floating_dtype_or_non_finite_values_are_refused(tmp_path, corrupt, message):
    from lapheads.runs import load_weights

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tensors["0.weight"] = corrupt(tensors["0.weight"])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message):
        load_weights(model, tmp_path / "model.safetensors")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was loaded

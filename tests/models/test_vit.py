"""timm ViTs with Laplacian heads."""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import save_file

import lapheads
from lapheads import HeadSpecError, LaplacianAttention, create_vit
from lapheads.models.vit import vit_laplacian_masks

SMALL = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=5)


def test_k_per_layer_and_per_layer_list():
    model = create_vit("vit_small_patch16_224", 2, **SMALL)
    assert vit_laplacian_masks(model) == [[False, True, True]] * 3
    model = create_vit("vit_small_patch16_224", "0,3,1", qk_norm=True, **SMALL)
    assert vit_laplacian_masks(model) == [[False] * 3, [True] * 3, [False, False, True]]
    assert isinstance(model.blocks[0].attn.q_norm, torch.nn.LayerNorm)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 5)


def test_zero_laplacian_heads_equals_timm_model():
    torch.manual_seed(0)
    reference = timm.create_model("vit_small_patch16_224", **SMALL).eval()
    ours = create_vit("vit_small_patch16_224", 0, **SMALL).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(ours(x), reference(x))


def test_pretrained_timm_file_loads_strictly_into_laplacian_model(tmp_path):
    torch.manual_seed(0)
    reference = timm.create_model("deit3_small_patch16_224", **SMALL)
    path = tmp_path / "deit3_small.safetensors"
    save_file(reference.state_dict(), str(path))
    model = create_vit("deit3_small_patch16_224", 3, pretrained_file=str(path), **SMALL)
    ours, theirs = model.state_dict(), reference.state_dict()
    # timm drops a classifier whose size differs from the pretrained config's (1000 classes), as in any fine-tune.
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs if not k.startswith("head."))
    assert vit_laplacian_masks(model) == [[True] * 3] * 3
    model.load_state_dict(reference.state_dict(), strict=True)


def test_registered_timm_names_after_import():
    assert "deit3_base_12L_patch16_192" in timm.list_models("deit3_*L_*")
    model = timm.create_model("deit3_small_5L_patch16_192", num_classes=10, depth=2)
    assert isinstance(model.blocks[0].attn, LaplacianAttention)
    assert vit_laplacian_masks(model) == [[False] + [True] * 5] * 2
    assert isinstance(model.blocks[0].attn.q_norm, torch.nn.LayerNorm)  # QK-norm, the paper's setting
    assert model.patch_embed.img_size == (192, 192)
    cpu = timm.create_model("vit_fmnist_patch4")
    assert cpu(torch.randn(1, 1, 28, 28)).shape == (1, 10)
    assert lapheads.create_vit is create_vit


def test_bad_model_and_bad_specs():
    with pytest.raises(ValueError, match="unknown model 'vit_nope'; allowed: a timm VisionTransformer name"):
        create_vit("vit_nope")
    with pytest.raises(HeadSpecError, match="laplacian_heads=4 is out of range; allowed: 0 to 3"):
        create_vit("vit_small_patch16_224", 4, **SMALL)
    with pytest.raises(HeadSpecError, match="has 2 entries .* but the model has 3 layers"):
        create_vit("vit_small_patch16_224", "1,1", **SMALL)
    with pytest.raises(ValueError, match="resnet18.* allowed: timm VisionTransformer"):
        create_vit("resnet18")


@pytest.mark.parametrize(
    "name, heads, size",
    [
        ("deit3_small_3L_patch16_224", 3, 224),
        ("deit3_base_9L_patch16_224", 9, 224),
        ("deit3_large_2L_patch16_192", 2, 192),
    ],
)
def test_the_authors_model_names_build_with_their_resolution(name, heads, size):
    with torch.device("meta"):
        model = timm.create_model(name, depth=2)
    masks = vit_laplacian_masks(model)
    assert [sum(m) for m in masks] == [heads, heads] and masks[0][-heads:] == [True] * heads
    assert model.patch_embed.img_size == (size, size) and model.pretrained_cfg["input_size"] == (3, size, size)
    assert model.no_embed_class and model.blocks[0].ls1.gamma.shape[0] == model.embed_dim


@pytest.mark.parametrize("name", ["vit_fmnist_patch4", "vit_lite_7_patch4_32", "deit3_small_1L_patch16_192"])
@pytest.mark.parametrize(
    "spec, expected", [(2, [[False, True, True]] * 3), ("0,3,1", [[False] * 3, [True] * 3, [False, False, True]])]
)
def test_timm_create_model_takes_a_head_spec_for_every_registered_name(name, spec, expected):
    model = timm.create_model(name, laplacian_heads=spec, depth=3, num_heads=3, embed_dim=48)
    assert vit_laplacian_masks(model) == expected
    assert all(isinstance(b.attn, LaplacianAttention) for b in model.blocks)
    size = model.patch_embed.img_size
    assert model.pretrained_cfg["input_size"][1:] == size


def test_a_registered_small_vit_without_a_spec_is_timms_model():
    torch.manual_seed(0)
    ours = timm.create_model("vit_fmnist_patch4", depth=2).eval()
    reference = timm.create_model("vit_fmnist_patch4", depth=2, attn_layer=timm.layers.Attention).eval()
    reference.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(ours(x), reference(x))
    assert vit_laplacian_masks(ours) == [[False] * 3] * 2

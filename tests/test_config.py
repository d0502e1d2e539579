"""Config resolution: presets, preset files, typed overrides and their errors."""

from __future__ import annotations

import json

import pytest

from lapheads.config import ConfigError
from lapheads.presets import CLASSIFY_PRESETS, resolve_classify_config


def test_presets_say_whose_recipe_they_follow():
    for name, cfg in CLASSIFY_PRESETS.items():
        assert cfg.description, name
    authors, official = CLASSIFY_PRESETS["deit3-base-imagenet"], CLASSIFY_PRESETS["deit3-base-imagenet-official"]
    assert (authors.img_size, authors.epochs, authors.batch_size, authors.lr, authors.optimizer) == (
        192,
        400,
        2048,
        2e-3,
        "adamw",
    )
    assert (official.epochs, official.optimizer, official.smoothing) == (800, "lamb", 0.0)


def test_overrides_are_typed():
    cfg = resolve_classify_config(
        "fmnist-cpu",
        "0,1,1,1,1,0",
        ["--lr", "2e-3", "--amp=false", "--clip-grad", "none", "--model-kwargs", '{"depth": 6}'],
    )
    assert (cfg.lr, cfg.amp, cfg.clip_grad, cfg.model_kwargs, cfg.laplacian_heads) == (
        2e-3,
        False,
        None,
        {"depth": 6},
        "0,1,1,1,1,0",
    )


def test_preset_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"lr": 0.01, "epochs": 3}))
    assert resolve_classify_config(str(path), None, []).lr == 0.01
    path.write_text(json.dumps({"learning_rate": 0.01}))
    with pytest.raises(ConfigError, match="unknown key.*learning_rate; allowed:"):
        resolve_classify_config(str(path), None, [])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--epochs", "many"], "--epochs='many' is not a valid"),
        (["--amp", "maybe"], "--amp='maybe' is not a valid"),
        (["--lr"], "--lr needs a value"),
        (["lr=3"], "unexpected argument 'lr=3'"),
    ],
)
def test_bad_overrides(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_classify_config("fmnist-cpu", None, overrides)


def test_list_fields_take_comma_lists_typed_by_their_elements():
    from lapheads.config import apply_overrides
    from lapheads.train.dino import DINOConfig

    cfg = apply_overrides(DINOConfig(), ["--local-scale", "0.2,0.5", "--global-scale=[0.5, 1]"])
    assert cfg.local_scale == [0.2, 0.5] and cfg.global_scale == [0.5, 1]

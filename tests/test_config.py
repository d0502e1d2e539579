"""Config resolution: presets, preset files, typed overrides and their errors."""

from __future__ import annotations

import json
import re

import pytest

from lapheads.config import ConfigError
from lapheads.tasks.presets import CLASSIFY_PRESETS, resolve_classify_config


def _short(x: float) -> str:
    mantissa, exponent = f"{x:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"  # 0.0015 -> 1.5e-3, as the descriptions write it


@pytest.mark.parametrize("name", list(CLASSIFY_PRESETS))
def test_a_preset_description_states_its_own_numbers(name):
    """--help shows the description: its epochs, batch and learning rate must be the preset's (they drifted before)."""
    cfg = CLASSIFY_PRESETS[name]
    assert cfg.description
    assert f"{cfg.epochs:g} epochs" in cfg.description
    assert re.search(rf"\b{cfg.batch_size}\b", cfg.description.replace(",", ""))
    assert f"lr {_short(cfg.lr)}" in cfg.description


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
        (["--epochs", "many"], "--epochs 'many': allowed: a finite number"),
        (["--amp", "maybe"], "--amp 'maybe': allowed: true or false or auto"),
        (["--lr"], "--lr needs a value"),
        (["lr=3"], "unexpected argument 'lr=3'"),
    ],
)
def test_bad_overrides(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve_classify_config("fmnist-cpu", None, overrides)


def test_list_fields_take_comma_lists_typed_by_their_elements():
    from lapheads.config import apply_overrides
    from lapheads.train.configs.dino import DINOConfig

    cfg = apply_overrides(DINOConfig(), ["--local-scale", "0.2,0.5", "--global-scale=[0.5, 1]"])
    assert cfg.local_scale == [0.2, 0.5] and cfg.global_scale == [0.5, 1]

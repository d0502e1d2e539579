"""Fixtures of the sweep and record tests."""

from __future__ import annotations

import dataclasses
import json

import pytest


@pytest.fixture
def tiny_preset(tiny_config, tmp_path):
    """A preset file of the tiny classifier: two evaluations, every field but the head spec (a sweep's axis)."""
    path = tmp_path / "tiny.json"
    cfg = dataclasses.replace(tiny_config, epochs=0.25, eval_every_epochs=0.125, log_every=4)  # two evaluations
    path.write_text(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k != "laplacian_heads"}))
    return path

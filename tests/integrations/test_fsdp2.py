"""Sharded Hugging Face training: a tiny Llama with Laplacian heads wrapped by FSDP2 (``fully_shard``) on 2 gloo
processes gives the losses and gradients of 1 process with the same global batch, and saves a model that reloads
with its Laplacian config (the run itself: fsdp2_llama.py, under torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import torchrun

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("fsdp2_llama.py")


def _torchrun(processes: int, out: Path) -> None:
    done = torchrun([str(SCRIPT), str(out)], processes=processes, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_fsdp2_on_two_processes_matches_one_and_saves_its_laplacian_config(tmp_path):
    import lapheads.hf as lhf

    _torchrun(1, tmp_path / "one")
    _torchrun(2, tmp_path / "two")
    one, two = (json.loads((tmp_path / d / "losses.json").read_text()) for d in ("one", "two"))
    assert one[-1] < one[0]  # it learns the batch
    assert two == pytest.approx(one, rel=1e-5)  # the same tokens per step: only summation order differs
    grads = [load_file(str(tmp_path / d / "grads.safetensors")) for d in ("one", "two")]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)
    loaded = lhf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "two" / "model").eval()
    assert loaded.config.laplacian_heads == [[False] * 4, [False, False, True, True]]
    assert [m.laplacian_mask.tolist() for m in lhf.attention_modules(loaded)] == loaded.config.laplacian_heads
    reference = lhf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "one" / "model").eval()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)

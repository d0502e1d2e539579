"""transformers' own model tests (``tests/test_modeling_common.py``'s ``ModelTesterMixin``, from the installed
version's source distribution on PyPI) on Llama, Qwen2 and GPT-OSS with the attention set to lapheads, slow-marked.

The sdist ships the shared mixins but not ``tests/models/``, so lapheads writes (never copies) a small model tester
per family. Where the suite lacks the generation or export tester that ``test_modeling_common.py`` imports, an empty
stand-in takes its place (its tests are then not run: stated, not hidden); where it has transformers' generation
tester, every family inherits it, so greedy, sampling, beam and assisted decoding with every cache run on Laplacian
heads too. Warnings stay on, as in transformers' own runs. Each family runs three times in one pytest process: the
family's own attention ("sdpa"; GPT-OSS, which has no SDPA path: "eager"), "lapheads" with k = 0, "lapheads" with
one Laplacian head per layer. Bars: at k = 0 the same tests pass and skip as with the family's own; at k = 1 every
test passes or skips as at k = 0 except the named comparisons whose reference is plain attention by design.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import peer_tests, run_peer_suite

transformers = pytest.importorskip("transformers")

#: tests that compare against plain attention (eager, SDPA: a Laplacian head computes another function on purpose)
#: or switch a model to it (refused on a config with Laplacian heads, so the heads are never dropped silently): at
#: k = 1 they are expected to differ
DIFFER_AT_K1 = re.compile(
    r"eager_matches|sdpa_matches|matches_sdpa|flash_attn|_can_dispatch|attention_outputs|sdpa_can_compile"
    r"|test_sdpa|test_eager|attn_implementation|flex_attention|set_attention"
    r"|sliding_window_mask"  # loads the model with attn_implementation="eager" for its attention maps
)

#: tests that ask for ``output_attentions``, which transformers' config allows under the implementation named "eager"
#: only (not "sdpa", not "lapheads"): against a family whose own attention is eager they differ at k = 0 too
NEEDS_THE_NAME_EAGER = re.compile(r"retain_grad_hidden_states_attentions|test_attention_outputs")

TESTER = '''
import unittest

import lapheads.integrations.hf  # noqa: F401 - registers "lapheads"
from transformers import {config}, {model}, {lm}

from .generation.test_utils import GenerationTesterMixin
from .test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask

# a source checkout ships transformers' generation tester (greedy, sampling, beam, assisted decoding with every
# cache): then every family runs it too; the sdist does not, and lapheads' stand-in says so
GENERATION = () if getattr(GenerationTesterMixin, "lapheads_stand_in", False) else (GenerationTesterMixin,)


class Tester:
    """A tiny {family}: 2 layers, 4 query heads over 2 key/value heads (GQA), 7 tokens."""

    batch_size, seq_length, is_training, vocab_size, hidden_size = 2, 7, True, 99, 32
    num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size = 2, 4, 2, {intermediate}

    def __init__(self, parent, attention, laplacian):
        self.parent, self.attention, self.laplacian = parent, attention, laplacian

    def get_config(self):
        config = {config}(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, max_position_embeddings=64, pad_token_id=0,
            attn_implementation=self.attention, {extra}
        )
        if self.attention == "lapheads":  # the last head of every layer Laplacian (k = 1), or none (k = 0)
            heads = self.num_attention_heads
            config.laplacian_heads = [[i >= heads - self.laplacian for i in range(heads)]] * self.num_hidden_layers
        return config

    def prepare_config_and_inputs_for_common(self):
        ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {{"input_ids": ids, "attention_mask": mask}}


class _Base(ModelTesterMixin, *GENERATION):
    all_model_classes = ({model}, {lm})
    all_generative_model_classes = ({lm},) if GENERATION else ()
    pipeline_model_mapping = {{}}
    attention, laplacian = "{reference}", 0

    def setUp(self):
        self.model_tester = Tester(self, self.attention, self.laplacian)


class Reference(_Base, unittest.TestCase):
    attention = "{reference}"


class LapheadsK0(_Base, unittest.TestCase):
    attention, laplacian = "lapheads", 0


class LapheadsK1(_Base, unittest.TestCase):
    attention, laplacian = "lapheads", 1
'''

#: each family's classes, its own attention (the reference: SDPA, or eager where it has no SDPA path) and the
#: config fields its tiny model needs beyond the tester's
FAMILIES = {
    "llama": dict(family="Llama", config="LlamaConfig", model="LlamaModel", lm="LlamaForCausalLM"),
    "qwen2": dict(family="Qwen2", config="Qwen2Config", model="Qwen2Model", lm="Qwen2ForCausalLM"),
    "gpt_oss": dict(
        family="GPT-OSS (learned sinks, sliding and full layers, experts)",
        config="GptOssConfig",
        model="GptOssModel",
        lm="GptOssForCausalLM",
        reference="eager",
        extra="head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,",
        intermediate=64,  # the experts' grouped matmul wants rows of a multiple of 16 bytes
        min_passed=80,  # 92 of its 162 tests pass under its own eager attention (its SDPA tests skip)
    ),
}


def _suite(cache: Path) -> Path:
    """The sdist's tests/ as a package (cached in the environment), with lapheads' stand-ins and testers."""
    folder = peer_tests("transformers", transformers.__version__, cache)
    (folder / "__init__.py").touch()
    for module, mixin in (
        ("exporters/test_export.py", "ExportTesterMixin"),
        ("generation/test_utils.py", "GenerationTesterMixin"),
    ):
        path = folder / module
        path.parent.mkdir(exist_ok=True)
        (path.parent / "__init__.py").touch()
        if not path.is_file() or "not in the sdist" in path.read_text():  # the sdist lacks them: empty stand-ins
            path.write_text(f"class {mixin}:\n    lapheads_stand_in = True  # not in the sdist; its tests do not run\n")
    for family, names in FAMILIES.items():
        tester = TESTER.format(**{"reference": "sdpa", "extra": "", "intermediate": 37, **names})
        (folder / f"test_lapheads_{family}.py").write_text(tester)
    return folder


def _outcomes(junit: Path) -> dict[str, dict[str, str]]:
    """{test class: {test: passed | skipped | failed}} from pytest's JUnit XML (per test, skips included)."""
    import xml.etree.ElementTree as ET

    found: dict[str, dict[str, str]] = {}
    for case in ET.parse(junit).iter("testcase"):
        status = "passed"
        for child in case:
            if child.tag in ("skipped", "failure", "error"):
                status = {"skipped": "skipped", "failure": "failed", "error": "failed"}[child.tag]
        found.setdefault(case.get("classname", "").rsplit(".", 1)[-1], {})[case.get("name")] = status
    return found


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_model_tests_pass_with_lapheads_as_with_the_familys_own_attention(family, tmp_path):
    folder = _suite(Path(sys.prefix) / "share" / "lapheads-transformers-tests")
    junit = tmp_path / "junit.xml"
    done = run_peer_suite(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
         f"tests/test_lapheads_{family}.py"],
        cwd=folder.parent,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert junit.is_file(), done.stdout[-3000:] + done.stderr[-2000:]
    found = _outcomes(junit)
    own, k0, k1 = (found.get(name, {}) for name in ("Reference", "LapheadsK0", "LapheadsK1"))
    assert sum(s == "passed" for s in own.values()) >= FAMILIES[family].get("min_passed", 100), done.stdout[-3000:]
    # k = 0: exactly the family's own outcomes, test by test (passes, skips and its own failures alike), but for
    # the output_attentions tests where the family's own attention is the one named "eager"
    eager = FAMILIES[family].get("reference") == "eager"
    mismatch = {t: (own.get(t), k0.get(t)) for t in set(own) | set(k0) if own.get(t) != k0.get(t)}
    assert not {t: v for t, v in mismatch.items() if not (eager and NEEDS_THE_NAME_EAGER.search(t))}, mismatch
    # k = 1: the same, except the comparisons with plain attention named in DIFFER_AT_K1
    differ = {t: (k0.get(t), s) for t, s in k1.items() if s != k0.get(t)}
    unexpected = {t: v for t, v in differ.items() if not DIFFER_AT_K1.search(t)}
    assert not unexpected, f"{unexpected}\n{done.stdout[-3000:]}"
    print(f"{family}: {len(own)} tests; its own attention and k = 0 alike; k = 1 differs on {len(differ)} named ones")

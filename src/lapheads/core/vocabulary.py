"""The head kinds' names and the written grammar of a head spec, without torch: what a config checks (and
``--help`` shows) before any model or op is loaded. Their arithmetic is ``lapheads.core.kinds``; the parser of a
spec into each layer's heads is ``lapheads.core.heads``."""

from __future__ import annotations

import re

from lapheads.config import Domain

__all__ = ["GATEABLE_KINDS", "GATE_PREFIX", "HEAD_KINDS", "HEAD_SPEC", "HEAD_SPEC_PATTERN", "LOCAL_TERM_KINDS"]

#: Every kind a head can be. A Laplacian head is an ordinary head with its P V term negated plus a token-local
#: term V (W_V x through W_O), the two tied by sharing W_V and W_O; the other kinds take those parts apart:
#: negated (the P V sign alone: an ordinary head with W_O negated, hence a placebo, kept only as one), local (an
#: ordinary head plus an untied local term that starts at zero), untied (the Laplacian head with only the tie
#: released: its own W_V', W_O' start equal to W_V, W_O), sum (V + P V: the same tied local term without the
#: cancellation (I - P) 1 = 0 the paper names as the mechanism), centring (V minus the attended mean: no attention),
#: exclusive (XSA, arXiv 2603.09078: P V minus its projection on the token's own value) and mix (learnable a, b).
HEAD_KINDS = ("ordinary", "laplacian", "negated", "local", "untied", "sum", "centring", "exclusive", "mix")
#: kinds whose module adds a token-local term W_O' W_V' x beside the op's output (untied from W_V, W_O)
LOCAL_TERM_KINDS = ("local", "untied")
#: how a gated head's kind is written ("gated-laplacian"), in specs and in saved configs
GATE_PREFIX = "gated-"
#: kinds a gate can scale: the head's whole output comes from the op (a local term is added after W_O, ungated)
GATEABLE_KINDS = tuple(kind for kind in HEAD_KINDS if kind not in LOCAL_TERM_KINDS)

_KIND_NAME = f"({GATE_PREFIX})?(" + "|".join(HEAD_KINDS) + ")"
_SPEC_ITEM = rf"\s*(\d+|{_KIND_NAME}(:\d+)?(\+{_KIND_NAME}:\d+)*|{_KIND_NAME}(/{_KIND_NAME})+)\s*"
#: The written form of every head spec ``parse_heads`` reads as text: items (a k, a kind, kind:k+kind:j or
#: kind/kind/...) separated by commas. Configs check it before a model exists; the counts are checked at build.
HEAD_SPEC_PATTERN = re.compile(rf"{_SPEC_ITEM}(,{_SPEC_ITEM})*")


#: ``--laplacian-heads`` in a config: k, one k per layer ("0,2,2,0"), or head kinds ("negated:3", "mix",
#: "ordinary/negated/laplacian", per layer too); the counts are checked against the model when it is built
HEAD_SPEC = Domain(
    "k, a comma list of per-layer k (3 or 0,2,2,0), or head kinds (negated:3, mix, ordinary/negated/laplacian, "
    "gated-laplacian:3; kinds: " + ", ".join(HEAD_KINDS) + "; any but local and untied as gated-<kind>)",
    lambda v: bool(HEAD_SPEC_PATTERN.fullmatch(v)),
)

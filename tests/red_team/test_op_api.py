"""Red team, the Python API (issue 28): every bad argument to the op, on the fused and the reference path alike, is
a one-line lapheads error that names the value, never a raw torch error.
"""

from __future__ import annotations

import pytest


def _api_cases():
    import torch

    def qkv(b=2, h=4, hkv=4, t=5, s=5, d=8, dtype=torch.float32):
        gen = torch.Generator().manual_seed(0)
        return (
            torch.randn(b, h, t, d, generator=gen, dtype=dtype),
            torch.randn(b, hkv, s, d, generator=gen, dtype=dtype),
            torch.randn(b, hkv, s, d, generator=gen, dtype=dtype),
        )

    q, k, v = qkv()
    cases = {
        # the head spec
        "k above H": ((q, k, v, 5), {}, "laplacian_heads=5 is out of range; allowed: 0 to 4"),
        "k negative": ((q, k, v, -1), {}, "laplacian_heads=-1 is out of range"),
        "k a bool": ((q, k, v, True), {}, "laplacian_heads=True is a bool"),
        "k a float": ((q, k, v, 1.5), {}, "1.5"),
        "k a string": ((q, k, v, "2"), {}, "'2'"),
        "a mask too short": ((q, k, v, [True, False]), {}, "not 4 bools"),
        "a mask of ints": ((q, k, v, [1, 0, 1, 0]), {}, "bool"),
        "a tensor mask of floats": ((q, k, v, torch.ones(4)), {}, "dtype"),
        "a tensor mask too long": ((q, k, v, torch.ones(5, dtype=torch.bool)), {}, "shape"),
        "an unknown kind": ((q, k, v, ["ordinary", "laplacian", "mystery", "ordinary"]), {}, "mystery"),
        "kinds too few": ((q, k, v, ["laplacian"]), {}, "head kinds"),
        "mix without coefficients": ((q, k, v, ["mix"] * 4), {}, "mix heads need mix=(a, b)"),
        "mix of the wrong shape": ((q, k, v, ["mix"] * 4), {"mix": (torch.zeros(3), torch.ones(3))}, "shape (4,)"),
        "blend with other kinds": ((q, k, v, ["negated"] * 4), {"blend": 0.5}, "blend applies to Laplacian heads"),
        # the tensors
        "q 3-D": ((q[0], k, v, 1), {}, "must be 4-D"),
        "k 5-D": ((q, k[None], v, 1), {}, "must be 4-D"),
        "H not a multiple of Hkv": ((*qkv(h=4, hkv=3), 1), {}, "H % Hkv == 0"),
        "k and v heads differ": ((q, k, v[:, :2], 1), {}, "H % Hkv == 0"),
        "batch sizes differ": ((q, k[:1], v[:1], 1), {}, "batch sizes differ"),
        "k and v lengths differ": ((q, k, v[:, :, :4], 1), {}, "the same S"),
        "head dims differ": ((q, k[..., :4], v, 1), {}, "head dims differ"),
        "more queries than keys": ((*qkv(t=6, s=5), 1), {}, "T <= S"),
        "mixed dtypes": ((q, k.double(), v, 1), {}, "dtypes"),
        "integer tensors": ((q.long(), k.long(), v.long(), 1), {}, "floating dtype"),
        # the options
        "an int mask": ((q, k, v, 1), {"attn_mask": torch.ones(5, 5, dtype=torch.int64)}, "attn_mask has dtype"),
        "a mask of the wrong shape": ((q, k, v, 1), {"attn_mask": torch.ones(3, 3, dtype=torch.bool)}, "broadcast"),
        "a mask of another batch": (
            (q, k, v, 1),
            {"attn_mask": torch.ones(3, 1, 5, 5, dtype=torch.bool)},
            "attn_mask of shape (3, 1, 5, 5) does not broadcast to (B, H, T, S)",
        ),
        "mask and is_causal with a cache": (
            (*qkv(t=3, s=5), 1),
            {"attn_mask": torch.ones(3, 5, dtype=torch.bool), "is_causal": True},
            "cannot be combined",
        ),
        "dropout above 1": ((q, k, v, 1), {"dropout_p": 1.5}, "dropout_p=1.5; allowed: a number in [0, 1]"),
        "dropout negative": ((q, k, v, 1), {"dropout_p": -0.1}, "dropout_p=-0.1"),
        "dropout a bool": ((q, k, v, 1), {"dropout_p": True}, "dropout_p=True"),
        "dropout a string": ((q, k, v, 1), {"dropout_p": "0.1"}, "dropout_p='0.1'"),
        "blend above 1": ((q, k, v, 1), {"blend": 1.5}, "blend=1.5; allowed: a number in [0, 1]"),
        "blend a float vector": ((q, k, v, 1), {"blend": torch.tensor([0.5])}, "blend tensor of dtype torch.float32"),
        "blend negative": ((q, k, v, 1), {"blend": -0.5}, "blend=-0.5"),
        "blend a tensor above 1": ((q, k, v, 1), {"blend": torch.tensor(2.0)}, "blend=2.0"),
        "blend a vector": ((q, k, v, 1), {"blend": torch.ones(2)}, "0-dim"),
        "blend a string": ((q, k, v, 1), {"blend": "1"}, "blend='1'"),
        "an unknown identity": ((q, k, v, 1), {"identity": "diagonal"}, "identity='diagonal'"),
        "the withdrawn identity name": ((q, k, v, 1), {"identity": "last_allowed"}, "identity='last_allowed'"),
        "attn_mask with is_causal": (
            (q, k, v, 1),
            {"attn_mask": torch.ones(5, 5, dtype=torch.bool), "is_causal": True},
            "cannot be combined",
        ),
    }
    return cases


API = _api_cases()


@pytest.mark.parametrize("path", ["fused", "reference"])
@pytest.mark.parametrize("name", sorted(API))
def test_api(name, path):
    from lapheads import laplacian_attention, laplacian_attention_reference
    from lapheads.errors import LapheadsError

    args, kwargs, says = API[name]
    op = laplacian_attention if path == "fused" else laplacian_attention_reference
    with pytest.raises(LapheadsError) as info:
        op(*args, **kwargs)
    message = str(info.value)
    assert says in message and "\n" not in message, (name, message)

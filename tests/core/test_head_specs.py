"""The one head-spec parser and its value: every accepted form, what a ``LayerHeads`` answers, and every error
naming the value and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lapheads import LayerHeads, parse_heads
from lapheads.core.heads import HeadSpecError


def masks(spec, num_heads, num_layers):
    return [list(heads.flags) for heads in parse_heads(spec, [num_heads] * num_layers)]


def test_int_marks_trailing_heads_in_every_layer():
    assert masks(2, 4, 3) == [[False, False, True, True]] * 3
    assert masks(0, 4, 2) == [[False] * 4] * 2
    assert masks(4, 4, 1) == [[True] * 4]


def test_strings_from_the_command_line():
    assert masks("3", 4, 2) == [[False, True, True, True]] * 2
    two = [False, False, True, True]
    assert masks(" 0, 2,2 ,0", 4, 4) == [[False] * 4, two, two, [False] * 4]


def test_per_layer_ints_masks_and_values():
    assert masks([1, 0], 2, 2) == [[False, True], [False, False]]
    assert masks([[True, False], torch.tensor([False, True])], 2, 2) == [[True, False], [False, True]]
    table = torch.tensor([[True, True], [False, False], [True, False]])
    assert masks(table, 2, 3) == table.tolist()
    layers = parse_heads("negated:1", [3, 3])
    assert parse_heads(layers, [3, 3]) == layers  # a model's own heads, handed back, are taken as they are


def test_layers_with_different_head_counts_read_one_item_against_each():
    """Swin's stages: one item for all layers is read against each layer's own count."""
    assert [h.kinds for h in parse_heads(2, [2, 4])] == [("laplacian",) * 2, ("ordinary",) * 2 + ("laplacian",) * 2]
    assert parse_heads("0,negated:1", [2, 4])[1].kinds == ("ordinary",) * 3 + ("negated",)
    with pytest.raises(HeadSpecError, match=r"laplacian_heads\[layer 0\]=3 is out of range; allowed: 0 to 2"):
        parse_heads(3, [2, 4])


def test_a_layers_heads_answer_what_models_and_the_op_need():
    heads = parse_heads("1", [3])[0]
    assert heads.kinds == ("ordinary", "ordinary", "laplacian") and heads.num_heads == 3
    assert heads.trailing == 1 and heads.plain and heads.num_laplacian == 1
    assert heads.mask.tolist() == [False, False, True] and heads.mask.device.type == "cpu"
    assert str(heads) == "1/3 Laplacian: [2]"
    scattered = parse_heads([[True, False, True]], [3])[0]
    assert scattered.trailing is None and scattered.num_laplacian == 2  # the op then gets the device mask
    kinds = parse_heads("negated:1+laplacian:1", [3])[0]
    assert not kinds.plain and kinds.trailing is None and kinds.flags == (False, False, True)
    assert parse_heads(0, [3])[0].trailing == 0


def test_the_value_is_frozen_and_its_mask_a_copy():
    heads = parse_heads(1, [3, 3])
    heads[0].mask[0] = True  # a new tensor each time: the layer's truth cannot be changed through it
    assert heads[0].mask.tolist() == heads[1].mask.tolist() == [False, False, True]
    with pytest.raises(dataclasses.FrozenInstanceError):
        heads[0].kinds = ("laplacian",) * 3
    with torch.device("meta"):  # the host truth holds its values under a meta-device context too
        assert parse_heads(1, [3])[0].mask.tolist() == [False, False, True]


@pytest.mark.parametrize(
    "kinds, message",
    [((), "non-empty"), (("sharpen",), "'sharpen'"), (["laplacian"], "tuple")],
    ids=repr,
)
def test_a_value_of_unknown_kinds_is_refused(kinds, message):
    with pytest.raises(HeadSpecError, match=message):
        LayerHeads(kinds)


@pytest.mark.parametrize(
    "spec, message",
    [
        (-1, "laplacian_heads=-1 is out of range; allowed: 0 to 4"),
        (5, "laplacian_heads=5 is out of range; allowed: 0 to 4"),
        ("5", "laplacian_heads=5 is out of range; allowed: 0 to 4"),
        ("-1", r"laplacian_heads='-1' is not a head spec; allowed: an int 0..4"),
        ([1, 2], r"laplacian_heads has 2 entries \[1, 2\] but the model has 3 layers"),
        ("1,2", r"laplacian_heads has 2 entries \['1', '2'\] but the model has 3 layers"),
        ([1, 5, 0], r"laplacian_heads\[layer 1\]=5 is out of range; allowed: 0 to 4"),
        ([1, -2, 0], r"laplacian_heads\[layer 1\]=-2 is out of range"),
        (True, "laplacian_heads=True is a bool; allowed: an int 0..4"),
        ([1, True, 0], r"laplacian_heads\[layer 1\]=True is a bool; allowed: an int 0..4"),
        (2.0, "laplacian_heads=2.0 is a float; allowed: an int 0..4"),
        ([1, 2.5, 0], r"laplacian_heads\[layer 1\]=2.5 is a float"),
        ("", "laplacian_heads is an empty string; allowed"),
        ("   ", "laplacian_heads is an empty string; allowed"),
        ("two", "laplacian_heads='two': unknown kind 'two'; allowed: an int 0..4"),
        ("1,,2", r"laplacian_heads='1,,2': laplacian_heads\[layer 1\]='' is not a head spec"),
        ("1.5", "laplacian_heads='1.5' is not a head spec"),
        (None, "laplacian_heads=None is a NoneType"),
        ([[True, False]] * 3, r"laplacian_heads\[layer 0\] mask \[True, False\] is not 4 bools"),
        (torch.ones(3, 4), "laplacian_heads tensor has dtype torch.float32 and shape \\(3, 4\\); allowed: a bool"),
        ([LayerHeads(("ordinary",) * 2)] * 3, r"laplacian_heads\[layer 0\] has 2 heads; allowed: 4"),
        ([torch.ones(4, dtype=torch.bool, device="meta")] * 3, r"\[layer 0\] is a meta-device tensor, which holds no"),
    ],
    ids=repr,
)
def test_errors_name_value_and_what_is_allowed(spec, message):
    with pytest.raises(HeadSpecError, match=message):
        parse_heads(spec, [4] * 3)


def test_error_is_one_line_and_a_value_error():
    with pytest.raises(ValueError) as info:
        parse_heads("0,9,0", [4] * 3)
    assert "\n" not in str(info.value)

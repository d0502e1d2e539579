"""The one head-spec parser: every accepted form, and every error naming the value and what is allowed."""

from __future__ import annotations

import pytest
import torch

from lapheads import laplacian_head_mask, parse_laplacian_heads
from lapheads.core.heads import HeadSpecError


def as_lists(masks):
    return [m.tolist() for m in masks]


def test_int_marks_trailing_heads_in_every_layer():
    assert as_lists(parse_laplacian_heads(2, num_heads=4, num_layers=3)) == [[False, False, True, True]] * 3
    assert as_lists(parse_laplacian_heads(0, 4, 2)) == [[False] * 4] * 2
    assert as_lists(parse_laplacian_heads(4, 4, 1)) == [[True] * 4]


def test_strings_from_the_command_line():
    assert as_lists(parse_laplacian_heads("3", 4, 2)) == [[False, True, True, True]] * 2
    assert as_lists(parse_laplacian_heads(" 0, 2,2 ,0", 4, 4)) == [
        [False] * 4,
        [False, False, True, True],
        [False, False, True, True],
        [False] * 4,
    ]


def test_per_layer_ints_and_masks():
    assert as_lists(parse_laplacian_heads([1, 0], 2, 2)) == [[False, True], [False, False]]
    masks = [[True, False], torch.tensor([False, True])]
    assert as_lists(parse_laplacian_heads(masks, 2, 2)) == [[True, False], [False, True]]
    table = torch.tensor([[True, True], [False, False], [True, False]])
    assert as_lists(parse_laplacian_heads(table, 2, 3)) == table.tolist()


def test_layers_get_independent_masks():
    masks = parse_laplacian_heads(1, 3, 2)
    masks[0][0] = True
    assert masks[1].tolist() == [False, False, True]


@pytest.mark.parametrize(
    "spec, message",
    [
        (-1, "laplacian_heads=-1 is out of range; allowed: 0 to 4"),
        (5, "laplacian_heads=5 is out of range; allowed: 0 to 4"),
        ("5", "laplacian_heads=5 is out of range; allowed: 0 to 4"),
        ("-1", r"laplacian_heads='-1' is not an int or a comma-separated int list; allowed: an int 0..4"),
        ([1, 2], r"laplacian_heads has 2 entries \[1, 2\] but the model has 3 layers"),
        ("1,2", r"laplacian_heads has 2 entries \[1, 2\] but the model has 3 layers"),
        ([1, 5, 0], r"laplacian_heads\[layer 1\]=5 is out of range; allowed: 0 to 4"),
        ([1, -2, 0], r"laplacian_heads\[layer 1\]=-2 is out of range"),
        (True, "laplacian_heads=True is a bool; allowed: an int 0..4"),
        ([1, True, 0], r"laplacian_heads\[layer 1\]=True is a bool; allowed: an int from 0 to 4"),
        (2.0, "laplacian_heads=2.0 is a float; allowed: an int 0..4"),
        ([1, 2.5, 0], r"laplacian_heads\[layer 1\]=2.5 is a float"),
        ("", "laplacian_heads is an empty string; allowed"),
        ("   ", "laplacian_heads is an empty string; allowed"),
        ("two", "laplacian_heads='two': unknown kind 'two'; allowed: an int 0..4"),
        ("1,,2", "laplacian_heads='1,,2' is not an int or a comma-separated int list"),
        ("1.5", "laplacian_heads='1.5' is not an int"),
        (None, "laplacian_heads=None is a NoneType"),
        ([[True, False]] * 3, r"laplacian_heads mask \[True, False\] is not 4 bools"),
        (torch.ones(3, 4), "laplacian_heads tensor has dtype torch.float32 and shape \\(3, 4\\); allowed: a bool"),
    ],
    ids=repr,
)
def test_errors_name_value_and_what_is_allowed(spec, message):
    with pytest.raises(HeadSpecError, match=message):
        parse_laplacian_heads(spec, num_heads=4, num_layers=3)


def test_error_is_one_line_and_a_value_error():
    with pytest.raises(ValueError) as info:
        parse_laplacian_heads("0,9,0", 4, 3)
    assert "\n" not in str(info.value)


def test_single_layer_mask_helper():
    assert laplacian_head_mask(1, 3).tolist() == [False, False, True]
    assert laplacian_head_mask([True, False, False], 3).tolist() == [True, False, False]
    with pytest.raises(HeadSpecError, match=r"shape \(3,\)"):
        laplacian_head_mask(torch.tensor([True, False]), 3)

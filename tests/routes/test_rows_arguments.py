"""`Routes.from_rows`'s placement arguments: whole numbers or a ValueError naming the value (a bool offset was taken
as 1, a float column or a None offset escaped as TypeError or passed, a float `seq_len` raised torch's TypeError)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_replay import LayerInfo, Routes

LAYERS = [LayerInfo("model.layers.0.mlp.gate", 8, 2)]
ROWS = [torch.tensor([[[0, 1]], [[2, 3]]])]  # one row: 2 positions, 1 column, K = 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(seq_len=3.5), "seq_len must be a whole number >= 0, got 3.5"),
        (dict(seq_len=True), "seq_len must be a whole number >= 0, got True"),
        (dict(seq_len=-1), "got -1"),
        (dict(columns=[0.0]), "columns must be whole numbers .* got \\[0.0\\]"),
        (dict(columns=[False]), "got \\[False\\]"),
        (dict(pad_left=[True]), "pad_left must hold whole numbers of positions, got \\[True\\]"),
        (dict(pad_left=[None]), "got \\[None\\]"),
        (dict(pad_left=[float("nan")]), "got \\[nan\\]"),
        (dict(pad_left=[1.5]), "got \\[1.5\\]"),
    ],
)
def test_placement_arguments_are_whole_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Routes.from_rows(ROWS, LAYERS, **kwargs)


def test_numpy_and_torch_whole_numbers_place_rows_as_ints_do():
    expected = Routes.from_rows(ROWS, LAYERS, pad_left=[1], seq_len=3, columns=[0])
    assert expected.mask.tolist() == [[False, True, True]]
    for pad_left in (np.array([1]), torch.tensor([1]), [1.0], [np.int64(1)]):
        got = Routes.from_rows(ROWS, LAYERS, pad_left=pad_left, seq_len=np.int64(3), columns=[np.int64(0)])
        assert got.equal(expected)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            np.full((1, 1, 2), 2**64 - 1, dtype=np.uint64),
            "row 0: expert id 18446744073709551615 outside int64",
        ),  # was -1
        (np.array([[[1 + 0j, 2]]]), "row 0: expected integer routes .* complex128"),  # NotImplementedError before
        (torch.tensor([[[1 + 0j, 2]]]), "torch.complex64"),
        (np.array([[[1, None]]], dtype=object), "got \\(1, 1, 2\\) object"),  # TypeError before
        ([[[0, 1]], [[0]]], "row 0: .* nested lists numpy cannot read"),  # numpy's own message, naming no row
        (np.array([[[0.0, 1.0]]]), "float64"),
    ],
)
def test_rows_of_other_dtypes_are_refused_naming_the_row(row, message):
    with pytest.raises(ValueError, match=message):
        Routes.from_rows([row], LAYERS)
    with pytest.raises(ValueError, match="columns must be whole numbers .* got \\[None\\]"):  # TypeError before
        Routes.from_rows(ROWS, LAYERS, columns=[None])


def test_a_bool_is_no_expert_count():
    with pytest.raises(ValueError, match="num_experts and top_k ints, got True, 1"):
        LayerInfo("model.layers.0.mlp.gate", True, 1)

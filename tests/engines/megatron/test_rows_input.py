"""Integer arrays entering the Megatron row and CP helpers are checked as given, before anything narrows them: a
wrapped, truncated or divided-by-zero result is a ValueError naming the value (no megatron-core needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_replay import LayerInfo, Routes
from moe_replay.engines.megatron import from_layer_rows
from moe_replay.routes.cp import from_cp, padded_len, to_cp

LAYER = [LayerInfo("decoder.layers.0.mlp.router", 8, 2)]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (torch.tensor([[0, 259]]), "expert index 259 outside \\[0, E=8\\)"),  # was cast to uint8 first: 259 -> 3
        (torch.tensor([[0, 1 << 40]]), f"expert index {1 << 40} outside"),
        (torch.tensor([[0, -1]]), "expert index -1 outside"),  # the message said 255
        (torch.tensor([[0, 300]], dtype=torch.uint16), "expert index 300 outside"),
        (torch.tensor([[0.0, 1.7]]), "rows must be an integer tensor .* got torch.float32"),  # was truncated to 1
        (torch.tensor([[True, False]]), "got torch.bool"),
        (np.array([[0, 1]]), "got ndarray"),
        (torch.tensor([[2, 2]]), "duplicate experts \\[2, 2\\]"),
    ],
)
def test_from_layer_rows_checks_ids_as_given(row, message):
    with pytest.raises(ValueError, match=message):
        from_layer_rows([row], 1, LAYER)


def test_from_layer_rows_keeps_ids_of_any_integer_dtype():
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16):
        routes = from_layer_rows([torch.tensor([[7, 0], [3, 5]], dtype=dtype)], 2, LAYER)
        assert routes.indices.dtype == torch.uint8 and routes.indices[:, 0, 0].tolist() == [[7, 0], [3, 5]]
    with pytest.raises(ValueError, match="do not split into batch_size=2.0"):
        from_layer_rows([torch.tensor([[0, 1], [2, 3]])], 2.0, LAYER)


def test_cp_sizes_and_ranks_are_whole_numbers_in_range():
    routes = Routes(
        torch.zeros(1, 4, 1, 2, dtype=torch.long) + torch.tensor([0, 1]), torch.ones(1, 4, dtype=torch.bool), LAYER
    )
    for cp_size, cp_rank, message in [
        (0, 0, "cp_size must be a whole number >= 1, got 0"),  # divided by zero before
        (-2, 0, "got -2"),
        (2.0, 0, "got 2.0"),
        (True, 0, "got True"),
        (2, 2, "cp_rank=2 must be in \\[0, cp_size=2\\)"),
        (2, 0.0, "cp_rank=0.0 must be in"),
    ]:
        with pytest.raises(ValueError, match=message):
            to_cp(routes, cp_size, cp_rank)
    with pytest.raises(ValueError, match="cp_size must be a whole number >= 1, got 0"):
        padded_len(10, 0)
    assert to_cp(routes, np.int64(2), np.int64(1)).seq_len == 2  # numpy ints are whole numbers too
    parts = [to_cp(routes, 2, r) for r in range(2)]
    with pytest.raises(ValueError, match="seq_len must be a whole number >= 0, got 3.5"):
        from_cp(parts, seq_len=3.5)
    with pytest.raises(ValueError, match="CP rank 1's part is a Tensor, not a Routes"):
        from_cp([parts[0], parts[1].indices])

"""Megatron's context-parallel layout against `Routes`: a reference permutation written the way megatron-core's
`get_batch_on_this_cp_rank` splits a batch (view as 2·CP chunks, index_select chunks r and 2·CP − 1 − r), round
trips for CP = 2 and 4, odd and even lengths, padding masks."""

from __future__ import annotations

import pytest
import torch

from moe_replay import LayerInfo, Routes
from moe_replay.engines.megatron.cp import cp_positions, padded_len, routes_from_cp, routes_to_cp


def reference_split(x: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """megatron-core's split of a [B, T, ...] tensor for one CP rank (T a multiple of 2·CP)."""
    chunks = x.view(x.shape[0], 2 * cp_size, x.shape[1] // (2 * cp_size), *x.shape[2:])
    picked = chunks.index_select(1, torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1]))
    return picked.reshape(x.shape[0], -1, *x.shape[2:])


def routes(B: int, T: int, seed: int) -> Routes:
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(B, T, 3, 8, generator=g).argsort(-1)[..., :2]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :3] = False  # left padding in one row, right padding in another
    mask[-1, T - 2 :] = False
    return Routes(idx, mask, [LayerInfo(f"decoder.layers.{i}.mlp.router", 8, 2) for i in range(3)])


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("T", [16, 13, 24, 7])
def test_cp_parts_match_megatrons_split_and_round_trip(cp_size, T):
    r = routes(3, T, seed=T * cp_size)
    padded = r.pad_to(padded_len(T, cp_size))
    assert padded.seq_len % (2 * cp_size) == 0
    parts = [routes_to_cp(r, cp_size, rank) for rank in range(cp_size)]
    for rank, part in enumerate(parts):
        assert torch.equal(part.indices, reference_split(padded.indices, cp_size, rank))
        assert torch.equal(part.mask, reference_split(padded.mask, cp_size, rank))
    back = routes_from_cp(parts, seq_len=T)
    assert back.equal(r) and torch.equal(back.indices[r.mask], r.indices[r.mask])
    covered = torch.cat([cp_positions(padded.seq_len, cp_size, rank) for rank in range(cp_size)])
    assert sorted(covered.tolist()) == list(range(padded.seq_len))  # every position on exactly one rank


def test_cp_errors_name_both_sides():
    with pytest.raises(ValueError, match="not a multiple of 2 x cp_size = 4"):
        cp_positions(10, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2 must be in \\[0, cp_size=2\\)"):
        cp_positions(8, 2, 2)
    r = routes(2, 8, 0)
    a, b = routes_to_cp(r, 2, 0), routes_to_cp(r[:1], 2, 1)
    with pytest.raises(ValueError, match="CP rank 1's part has B=1, T=4 .* but rank 0's has B=2, T=4"):
        routes_from_cp([a, b])
    with pytest.raises(ValueError, match="recorded positions lie beyond it"):
        routes_from_cp([routes_to_cp(r, 2, k) for k in range(2)], seq_len=5)

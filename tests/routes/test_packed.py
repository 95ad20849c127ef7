"""Packed (THD) routes: `to_packed` / `from_packed` round trips for left and right padding and per-sequence
padding multiples, the boundaries Megatron's PackedSeqParams take, and errors naming both sides."""

from __future__ import annotations

import pytest
import torch

from moe_replay import LayerInfo, Routes
from moe_replay.routes import from_packed, to_packed

LAYERS = [LayerInfo(f"decoder.layers.{i}.mlp.router", 8, 2) for i in range(3)]


def batch(lengths: list[int], T: int, left: bool, seed: int = 0) -> tuple[Routes, torch.Tensor]:
    """Routes [B, T] whose row i holds lengths[i] tokens (left or right padded), the last token of each unrecorded
    (as a sampled answer's is), and the attention mask."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(len(lengths), T, 3, 8, generator=g).argsort(-1)[..., :2]
    pos = torch.arange(T)[None]
    n = torch.tensor(lengths)[:, None]
    keep = pos >= T - n if left else pos < n
    mask = keep.clone()
    last = torch.where(keep, pos, -1).max(1).values
    mask[torch.arange(len(lengths)), last.clamp(min=0)] &= last < 0  # (empty rows have nothing to unmark)
    return Routes(idx, mask, LAYERS), keep.long()


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("multiple", [1, 4])
def test_pack_then_unpack_gives_the_batch_back(left, multiple):
    routes, keep = batch([5, 8, 1, 0, 3], T=8, left=left)
    packed = to_packed(routes, keep, multiple=multiple)
    lengths = keep.sum(1)
    assert packed.cu_seqlens.tolist() == [0, *lengths.cumsum(0).tolist()]
    padded = -(-lengths // multiple) * multiple
    assert packed.cu_seqlens_padded.tolist() == [0, *padded.cumsum(0).tolist()]
    assert packed.cu_seqlens.dtype == packed.cu_seqlens_padded.dtype == torch.int32
    assert packed.routes.shape == (1, int(padded.sum()), 3, 2)
    for i in range(routes.batch_size):  # sequence i's tokens, in order, from its padded start
        start = int(packed.cu_seqlens_padded[i])
        got = packed.routes.indices[0, start : start + int(lengths[i])]
        assert torch.equal(got, routes.indices[i][keep[i].bool()])
        assert torch.equal(packed.routes.mask[0, start : start + int(lengths[i])], routes.mask[i][keep[i].bool()])
        assert not packed.routes.mask[0, start + int(lengths[i]) : int(packed.cu_seqlens_padded[i + 1])].any()
    back = from_packed(packed.routes, packed.cu_seqlens, keep, cu_seqlens_padded=packed.cu_seqlens_padded)
    assert back.equal(routes)


def test_unpack_drops_routes_recorded_in_the_padding_between_sequences():
    routes, keep = batch([3, 2], T=4, left=False)
    packed = to_packed(routes, keep, multiple=4)
    indices = packed.routes.indices.clone()
    indices[~packed.routes.mask] = torch.tensor([0, 1], dtype=indices.dtype)  # valid ids where padding tokens ran
    recorded_everywhere = Routes(indices, torch.ones_like(packed.routes.mask), LAYERS)
    back = from_packed(recorded_everywhere, packed.cu_seqlens, keep, cu_seqlens_padded=packed.cu_seqlens_padded)
    assert torch.equal(back.mask, keep.bool())  # (a recording on the packed row routes its padding tokens too)


def test_packing_errors_name_both_sides():
    routes, keep = batch([3, 4], T=4, left=False)
    with pytest.raises(ValueError, match="attention_mask is \\(2, 5\\) but the routes are B=2, T=4"):
        to_packed(routes, torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="0/1 integers or bools, got torch.float32"):
        to_packed(routes, keep.float())
    with pytest.raises(ValueError, match="only 0 and 1"):
        to_packed(routes, keep * 2)
    with pytest.raises(ValueError, match="multiple must be a whole number >= 1, got 0"):
        to_packed(routes, keep, multiple=0)
    shifted = keep.roll(1, dims=1)
    with pytest.raises(ValueError, match="sequence 0 has a route recorded at position 0, which its attention_mask"):
        to_packed(routes, shifted)
    packed = to_packed(routes, keep, multiple=4)
    row = Routes(packed.routes.indices, packed.routes.mask, LAYERS)  # a plain row: the boundaries come from the caller
    with pytest.raises(ValueError, match="sequence 0: cu_seqlens give 4 tokens but its attention_mask row keeps 3"):
        from_packed(row, torch.tensor([0, 4, 7]), keep, cu_seqlens_padded=packed.cu_seqlens_padded)
    with pytest.raises(ValueError, match="cu_seqlens has 2 entries but 2 sequences need 3"):
        from_packed(row, torch.tensor([0, 7]), keep)
    with pytest.raises(ValueError, match="must start at 0 and never decrease, got \\[1, 4, 8\\]"):
        from_packed(row, packed.cu_seqlens, keep, cu_seqlens_padded=torch.tensor([1, 4, 8]))
    with pytest.raises(ValueError, match="do not hold the sequences' lengths \\[3, 4\\] within the packed row of N=8"):
        from_packed(row, packed.cu_seqlens, keep, cu_seqlens_padded=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="1-D integer tensor, got torch.float32"):
        from_packed(packed.routes, packed.cu_seqlens.float(), keep)
    with pytest.raises(ValueError, match="packed Routes of one row \\(B=1\\), got B=2"):
        from_packed(routes, packed.cu_seqlens, keep)


def test_unpack_refuses_boundaries_that_contradict_the_packed_routes_own():
    """`cu_seqlens` passed for `cu_seqlens_padded` after `multiple=4` (found by review: every later sequence was read
    one or more positions early, no error); `to_cp` refuses the same contradiction."""
    routes, keep = batch([3, 5, 2], T=6, left=False)
    packed = to_packed(routes, keep, multiple=4)
    assert packed.cu_seqlens.tolist() != packed.cu_seqlens_padded.tolist()
    with pytest.raises(ValueError, match=r"cu_seqlens_padded=\[0, 3, 8, 10\] was given for packed sequences starting "
                       r"at \[0, 4, 12\], whose cu_seqlens_padded are \[0, 4, 12, 16\]"):  # fmt: skip
        from_packed(packed.routes, packed.cu_seqlens, keep, cu_seqlens_padded=packed.cu_seqlens)
    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 4, 12, 16\] was given .* whose cu_seqlens are \[0, 3, 8"):
        from_packed(packed.routes, packed.cu_seqlens_padded, keep, cu_seqlens_padded=packed.cu_seqlens_padded)
    # the routes' own boundaries, given or not, read every recorded position back
    for given in ({}, {"cu_seqlens_padded": packed.cu_seqlens_padded}):
        assert from_packed(packed.routes, packed.cu_seqlens, keep, **given).equal(routes)

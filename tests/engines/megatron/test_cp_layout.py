"""Megatron's context-parallel layouts against `Routes`: reference splits written the way megatron-core's
`get_batch_on_this_cp_rank` splits a batch (view as 2·CP chunks, index_select chunks r and 2·CP − 1 − r) and as it
documents the per-document split of a packed row (the same per document), round trips for CP = 1, 2 and 4, odd and
even lengths, padding masks; a part's place (`CPRoutes`) and the errors for parts of the wrong place."""

from __future__ import annotations

import pytest
import torch
from cp_worker import reference_cp_split as reference_split
from cp_worker import reference_thd_split

from moe_replay import LayerInfo, Routes
from moe_replay.routes.cp import CPRoutes, cp_positions, from_cp, padded_len, to_cp


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
    parts = [to_cp(r, cp_size, rank) for rank in range(cp_size)]
    for rank, part in enumerate(parts):
        assert torch.equal(part.indices, reference_split(padded.indices, cp_size, rank))
        assert torch.equal(part.mask, reference_split(padded.mask, cp_size, rank))
    back = from_cp(parts, seq_len=T)
    assert back.equal(r) and torch.equal(back.indices[r.mask], r.indices[r.mask])
    covered = torch.cat([cp_positions(padded.seq_len, cp_size, rank) for rank in range(cp_size)])
    assert sorted(covered.tolist()) == list(range(padded.seq_len))  # every position on exactly one rank


def test_cp_errors_name_both_sides():
    with pytest.raises(ValueError, match="not a multiple of 2 x cp_size = 4"):
        cp_positions(10, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2 must be in \\[0, cp_size=2\\)"):
        cp_positions(8, 2, 2)
    r = routes(2, 8, 0)
    a, b = to_cp(r, 2, 0), to_cp(r[:1], 2, 1)
    with pytest.raises(ValueError, match="CP rank 1's part has B=1, T=4 .* but rank 0's has B=2, T=4"):
        from_cp([a, b])
    with pytest.raises(ValueError, match="recorded positions lie beyond it"):
        from_cp([to_cp(r, 2, k) for k in range(2)], seq_len=5)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("lengths", [(8,), (8, 16, 8), (24, 8)])
def test_thd_parts_match_the_documented_per_document_split_and_round_trip(cp_size, lengths):
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]  # (every document a multiple of 2 x CP = 8)
    r = routes(1, cu[-1], seed=len(lengths) * cp_size)
    parts = [to_cp(r, cp_size, rank, cu_seqlens_padded=cu) for rank in range(cp_size)]
    for rank, part in enumerate(parts):
        assert torch.equal(part.indices, reference_thd_split(r.indices, cu, cp_size, rank))
        assert torch.equal(part.mask, reference_thd_split(r.mask, cu, cp_size, rank))
        assert part.where() == f"CP rank {rank} of {cp_size} (per-document, cu_seqlens_padded {cu} layout)"
    assert from_cp(parts).equal(r)
    plain = [Routes(p.indices, p.mask, p.layers) for p in parts]  # parts read back from files: the layout is given
    assert from_cp(plain, cu_seqlens_padded=torch.tensor(cu)).equal(r)


def test_a_part_keeps_its_place_when_moved_or_minibatched_and_loses_it_otherwise():
    r = routes(3, 8, 0)
    part = to_cp(r, 2, 1)
    for kept in (part.to("cpu"), part[1:], part[0]):
        assert isinstance(kept, CPRoutes) and (kept.cp_size, kept.cp_rank, kept.cu_seqlens_padded) == (2, 1, None)
    for lost in (part.pad_to(6), Routes.cat([part, part])):
        assert type(lost) is Routes
    assert "CP rank 1 of 2 (per-sequence layout)" in repr(part)


def test_thd_and_place_errors_name_both_sides():
    r = routes(1, 16, 0)
    with pytest.raises(
        ValueError, match="document 1 of cu_seqlens_padded \\[0, 8, 14, 16\\] is 6 long, not a multiple"
    ):
        to_cp(r, 2, 0, cu_seqlens_padded=[0, 8, 14, 16])
    with pytest.raises(ValueError, match="cu_seqlens_padded\\[-1\\] = 8 positions, but the routes are B=1, T=16"):
        to_cp(r, 2, 0, cu_seqlens_padded=[0, 8])
    with pytest.raises(ValueError, match="one packed row .* but the routes are B=2"):
        to_cp(routes(2, 8, 0), 2, 0, cu_seqlens_padded=[0, 8])
    with pytest.raises(ValueError, match="must start at 0 and never decrease, got \\[0, 8, 4\\]"):
        to_cp(r, 2, 0, cu_seqlens_padded=[0, 8, 4])
    parts = [to_cp(r, 2, k) for k in range(2)]
    with pytest.raises(ValueError, match="already a part \\(CP rank 0 of 2"):
        to_cp(parts[0], 2, 0)
    with pytest.raises(ValueError, match="part 0 of 2 is CP rank 1 of 2 .* in rank order"):
        from_cp(parts[::-1])
    with pytest.raises(ValueError, match="some know their place and some not: .*'a plain Routes'"):
        from_cp([parts[0], Routes(parts[1].indices, parts[1].mask, parts[1].layers)])
    with pytest.raises(ValueError, match="part 0 is CP rank 0 of 2 \\(per-sequence layout\\) but cu_seqlens_padded"):
        from_cp(parts, cu_seqlens_padded=[0, 16])
    thd = [to_cp(r, 2, k, cu_seqlens_padded=[0, 8, 16]) for k in range(2)]
    with pytest.raises(ValueError, match="different layouts"):
        from_cp([thd[0], parts[1]])
    plain = [Routes(p.indices, p.mask, p.layers) for p in parts]
    with pytest.raises(ValueError, match="2 parts of T=8 make 16 positions but cu_seqlens_padded ends at 12"):
        from_cp(plain, cu_seqlens_padded=[0, 12])
    odd = [Routes(p.indices[:, :3], p.mask[:, :3], p.layers) for p in parts]
    with pytest.raises(ValueError, match="2 parts of T=3 make 6 positions, not a multiple of 2 x cp_size = 4"):
        from_cp(odd)


def test_placed_routes_from_a_file_or_built_by_hand(tmp_path):
    """A file holds no place (loading gives a plain Routes); a CPRoutes built by hand needs its place; a pickle (as
    all_gather_object sends it) keeps it."""
    import pickle

    part = to_cp(routes(2, 8, 0), 2, 1)
    part.save(tmp_path / "part.safetensors")
    assert type(CPRoutes.load(tmp_path / "part.safetensors")) is Routes
    with pytest.raises(TypeError, match="CPRoutes needs its place \\['cp_size', 'cp_rank', 'cu_seqlens_padded'\\]"):
        CPRoutes(part.indices, part.mask, part.layers)
    made = CPRoutes(part.indices, part.mask, part.layers, cp_size=2, cp_rank=1, cu_seqlens_padded=None)
    assert made.where() == part.where() and made.equal(part)
    back = pickle.loads(pickle.dumps(part))
    assert isinstance(back, CPRoutes) and back.place() == part.place()

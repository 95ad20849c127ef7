"""Property tests of the layout functions (hypothesis, bounded and derandomized so the suite stays fast and the same on
every machine): pack <-> unpack, CP split <-> join, segments <-> assembly. Consistent inputs round-trip every recorded
position (and its version); inputs that contradict themselves are refused, never read another way."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_replay.routes import LayerInfo, Routes, Segment, assemble_routes, from_cp, from_packed, to_cp, to_packed

E, K = 8, 2
BOUNDED = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def layers(n: int) -> list[LayerInfo]:
    return [LayerInfo(f"model.layers.{i}.mlp.gate", E, K) for i in range(n)]


def expert_sets(g: torch.Generator, B: int, T: int, L: int) -> torch.Tensor:
    """Random distinct top-K expert ids [B, T, L, K]."""
    return torch.rand(B, T, L, E, generator=g).argsort(-1)[..., :K]


@st.composite
def batches(draw: st.DrawFn) -> tuple[Routes, torch.Tensor]:
    """Routes [B, T, L, K] with versions, recorded at a random subset of each row's real tokens (left or right
    padded, empty rows included), and the batch's attention mask."""
    B, T, L = draw(st.integers(1, 4)), draw(st.integers(1, 9)), draw(st.integers(1, 3))
    lengths = [draw(st.integers(0, T)) for _ in range(B)]
    left = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    pos = torch.arange(T)[None]
    n = torch.tensor(lengths)[:, None]
    keep = pos >= T - n if left else pos < n
    mask = keep & (torch.rand(B, T, generator=g) < 0.8)
    version = torch.randint(0, 5, (B, T), generator=g, dtype=torch.int32)
    return Routes(expert_sets(g, B, T, L), mask, layers(L), version * mask), keep.long()


def padding_position(keep: torch.Tensor) -> tuple[int, int] | None:
    """A (row, position) the attention mask marks padding, if any."""
    found = (keep == 0).nonzero()
    return None if not len(found) else (int(found[0, 0]), int(found[0, 1]))


@BOUNDED
@given(batches(), st.integers(1, 4))
def test_pack_then_unpack_gives_every_recorded_position_back(batch, multiple):
    routes, keep = batch
    packed = to_packed(routes, keep, multiple=multiple)
    assert int(packed.routes.mask.sum()) == int(routes.mask.sum())
    back = from_packed(packed.routes, packed.cu_seqlens, keep, cu_seqlens_padded=packed.cu_seqlens_padded)
    assert back.equal(routes) and torch.equal(back.version, routes.version)
    assert from_packed(packed.routes, packed.cu_seqlens, keep).equal(routes)  # (its own boundaries by default)


@BOUNDED
@given(batches(), st.integers(2, 4))
def test_packing_refuses_what_contradicts_itself(batch, multiple):
    routes, keep = batch
    at = padding_position(keep)
    if at is not None:  # a route recorded where the mask says padding: the mask is not the forward's
        mask = routes.mask.clone()
        mask[at] = True
        with pytest.raises(ValueError, match="which its attention_mask marks padding"):
            to_packed(Routes(routes.indices, mask, routes.layers), keep, multiple=multiple)
    packed = to_packed(routes, keep, multiple=multiple)
    if not torch.equal(packed.cu_seqlens, packed.cu_seqlens_padded):  # the other boundaries: never read early
        with pytest.raises(ValueError, match="was given for packed sequences starting at"):
            from_packed(packed.routes, packed.cu_seqlens, keep, cu_seqlens_padded=packed.cu_seqlens)
    if keep.sum(1).max() < keep.shape[1]:  # a mask whose rows keep other lengths than the packed sequences'
        longer = keep.clone()
        row = int(keep.sum(1).argmax())
        longer[row] = 1
        with pytest.raises(ValueError, match=f"sequence {row}: cu_seqlens give"):
            from_packed(packed.routes, packed.cu_seqlens, longer)


@BOUNDED
@given(batches(), st.integers(1, 3))
def test_cp_split_then_join_gives_every_recorded_position_back(batch, cp_size):
    routes, keep = batch
    parts = [to_cp(routes, cp_size, r) for r in range(cp_size)]
    assert from_cp(parts, seq_len=routes.seq_len).equal(routes)
    packed = to_packed(routes, keep, multiple=2 * cp_size).routes  # per document, the row's own boundaries
    parts = [to_cp(packed, cp_size, r) for r in range(cp_size)]
    whole = from_cp(parts)
    assert whole.equal(packed) and torch.equal(whole.version, packed.version)
    if cp_size > 1:  # parts out of rank order, or another row's boundaries: refused
        with pytest.raises(ValueError, match="pass every rank's part, in rank order"):
            from_cp(parts[::-1])
        other = list(packed.cu_seqlens_padded)
        if len(other) > 2 and other[1] + 2 * cp_size <= other[2]:
            other[1] += 2 * cp_size
            with pytest.raises(ValueError, match="cu_seqlens_padded=.* was given for"):
                to_cp(packed, cp_size, 0, cu_seqlens_padded=other)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[tuple[int, int, int, int]], int, int]:
    """Per conversation (prompt, turn-1 answer, environment, turn-2 answer) token counts; L; a seed."""
    B = draw(st.integers(1, 3))
    shape = st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(0, 3), st.integers(1, 3))
    return [draw(shape) for _ in range(B)], draw(st.integers(1, 2)), draw(st.integers(0, 2**16))


def left_padded(true: torch.Tensor, lengths: list[int], recorded: list[int]) -> tuple[Routes, torch.Tensor]:
    """A segment's batch: row b holds conversation positions [0, lengths[b]) left-padded, recorded at [0,
    recorded[b]), their routes from `true` [B, N, L, K]."""
    B, W, L = len(lengths), max(lengths), true.shape[2]
    indices = torch.zeros(B, W, L, K, dtype=true.dtype)
    mask, real = torch.zeros(B, W, dtype=torch.bool), torch.zeros(B, W, dtype=torch.long)
    for b, (n, r) in enumerate(zip(lengths, recorded, strict=True)):
        indices[b, W - n :] = true[b, :n]
        real[b, W - n :] = 1
        mask[b, W - n : W - n + r] = True
    return Routes(indices, mask, layers(L)), real


@BOUNDED
@given(conversations())
def test_two_turns_assemble_to_every_position_with_the_version_of_its_forward(case):
    """Turn 1 (version 1) samples its answer; turn 2 (version 2, no cache kept) re-runs the conversation and samples
    its own: each position's route is the conversation's, its version the turn that sampled from it, or else the
    first that computed it. A segment whose mask contradicts its routes is refused."""
    shapes, L, seed = case
    g = torch.Generator().manual_seed(seed)
    totals = [p + c + e + d for p, c, e, d in shapes]
    true = expert_sets(g, len(shapes), max(totals), L)
    first_len = [p + c for p, c, _, _ in shapes]
    turn1, real1 = left_padded(true, first_len, [n - 1 for n in first_len])  # (the last sampled token is not fed)
    turn2, real2 = left_padded(true, totals, [n - 1 for n in totals])
    seg1 = Segment(turn1, real1, version=1, sampled_from=[p - 1 for p, _, _, _ in shapes])
    seg2 = Segment(turn2, real2, version=2, sampled_from=[p + c + e - 1 for p, c, e, _ in shapes])
    W = max(totals)
    batch = torch.zeros(len(shapes), W, dtype=torch.long)  # the trainer's batch: right padded
    for b, n in enumerate(totals):
        batch[b, :n] = 1
    got = assemble_routes([seg1, seg2], batch)
    for b, ((p, c, _, _), n) in enumerate(zip(shapes, totals, strict=True)):
        assert torch.equal(got.mask[b, : n - 1], torch.ones(n - 1, dtype=torch.bool)) and not got.mask[b, n - 1 :].any()
        assert torch.equal(got.indices[b, : n - 1], true[b, : n - 1])
        expected = torch.full((n - 1,), 2, dtype=torch.int32)
        expected[: p + c - 1] = 1  # turn 1 computed these first (and sampled from p - 1 on)
        assert torch.equal(got.version[b, : n - 1], expected)
    flipped = Segment(turn2, real2.flip(1), version=2, sampled_from=seg2.sampled_from)
    if (turn2.mask & (real2.flip(1) == 0)).any():  # a right-padded mask for a left-padded turn that calls a recorded
        # position padding: refused, not shifted (one that does not is a consistent partial recording)
        with pytest.raises(ValueError, match="which its attention_mask marks padding"):
            assemble_routes([seg1, flipped], batch)
    with pytest.raises(ValueError, match="versions cannot go backwards"):
        assemble_routes([seg2, seg1], batch)

"""Megatron's context-parallel sequence layouts and `Routes`, both ways.

With context parallelism (CP) megatron-core splits each sequence into 2·CP equal chunks and gives CP rank r chunks r
and 2·CP − 1 − r, concatenated (`get_batch_on_this_cp_rank`: balanced causal attention work), so a sequence's length
must be a multiple of 2·CP. A packed (THD) row is split the same way per document (`cu_seqlens_padded` boundaries,
each document a multiple of 2·CP long; Transformer Engine's `thd_get_partitioned_indices`). `to_cp` gives a
rank its part of a `Routes` [B, T, L, K] in either layout as a `CPRoutes`, which knows its place and which the
Megatron contexts check against the rank they run on; `from_cp` puts the ranks' parts back together.

Shape legend: B sequences, T positions, L layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .core import Routes
from .index import is_integer_scalar
from .packed import PackedRoutes, boundaries
from .placed import PlacedRoutes


class CPRoutes(PlacedRoutes):
    """A context-parallel rank's part of a batch's routes, knowing its place: `cp_size`, `cp_rank` and, for a packed
    (THD) row split per document, the whole row's `cu_seqlens_padded` (None: the per-sequence layout). Moving it
    (`.to`), selecting sequences and pickling keep the place; padding, joining or a file give a plain `Routes`.

    Example:
        >>> part = to_cp(routes, cp_size=2, cp_rank=1)  # doctest: +SKIP
        >>> part.cp_rank, part.where()  # doctest: +SKIP
        (1, 'CP rank 1 of 2 (per-sequence layout)')
    """

    PLACE = ("cp_size", "cp_rank", "cu_seqlens_padded")
    cp_size: int
    cp_rank: int
    cu_seqlens_padded: tuple[int, ...] | None

    def where(self) -> str:
        """The place in words, for messages."""
        cu = self.cu_seqlens_padded
        layout = "per-sequence" if cu is None else f"per-document, cu_seqlens_padded {list(cu)}"
        return f"CP rank {self.cp_rank} of {self.cp_size} ({layout} layout)"


def part_of(routes: Routes, cp_size: int, cp_rank: int, cu_seqlens_padded: tuple[int, ...] | None) -> CPRoutes:
    """`routes` (already in the rank's layout) as CP rank `cp_rank`'s part."""
    return CPRoutes.placed(routes, cp_size=int(cp_size), cp_rank=int(cp_rank), cu_seqlens_padded=cu_seqlens_padded)


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions of a sequence of `seq_len` (a multiple of 2·`cp_size`) that CP rank `cp_rank` holds, in order.

    Example:
        >>> cp_positions(8, cp_size=2, cp_rank=0).tolist(), cp_positions(8, cp_size=2, cp_rank=1).tolist()
        ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    check_cp(cp_size, cp_rank)
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x cp_size = {chunks}")
    size = seq_len // chunks
    first, second = cp_rank * size, (chunks - 1 - cp_rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


def check_cp(cp_size: int, cp_rank: int | None = None) -> None:
    """Raise ValueError unless `cp_size` is a whole number >= 1 and `cp_rank` (if given) one in [0, cp_size).

    Example:
        >>> check_cp(2, 1)
    """
    if not is_integer_scalar(cp_size) or cp_size < 1:
        raise ValueError(f"cp_size must be a whole number >= 1, got {cp_size!r}")
    if cp_rank is not None and (not is_integer_scalar(cp_rank) or not 0 <= cp_rank < cp_size):
        raise ValueError(f"cp_rank={cp_rank!r} must be in [0, cp_size={cp_size}), a whole number")


def padded_len(seq_len: int, cp_size: int) -> int:
    """`seq_len` rounded up to a multiple of 2·`cp_size` (megatron-core needs one).

    Example:
        >>> padded_len(10, 2)
        12
    """
    check_cp(cp_size)
    return -(-seq_len // (2 * cp_size)) * 2 * cp_size


def thd_cp_positions(cu_seqlens_padded: Sequence[int] | torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions of a packed row that CP rank `cp_rank` holds when megatron-core splits it per document: each
    document (between consecutive `cu_seqlens_padded`, a multiple of 2·`cp_size` long) in 2·CP chunks, the rank taking
    chunks r and 2·CP − 1 − r of every document, documents in order (Transformer Engine's `thd_get_partitioned_indices`
    over the whole row).

    Example:
        >>> thd_cp_positions([0, 4, 12], cp_size=2, cp_rank=0).tolist()
        [0, 3, 4, 5, 10, 11]
    """
    check_cp(cp_size, cp_rank)
    cu = boundaries(torch.as_tensor(cu_seqlens_padded), "cu_seqlens_padded")
    lengths = cu[1:] - cu[:-1]
    odd = (lengths % (2 * cp_size)).nonzero()
    if odd.numel():
        d = int(odd[0])
        raise ValueError(
            f"document {d} of cu_seqlens_padded {cu.tolist()} is {int(lengths[d])} long, not a multiple of "
            f"2 x cp_size = {2 * cp_size} (pad each document: to_packed(..., multiple={2 * cp_size}))"
        )
    parts = [
        start + cp_positions(int(n), cp_size, cp_rank)
        for start, n in zip(cu[:-1].tolist(), lengths.tolist(), strict=True)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _as_cu(cu_seqlens_padded: Any) -> tuple[int, ...] | None:
    """The boundaries as a tuple of ints (a CPRoutes' place), checked; None stays None."""
    if cu_seqlens_padded is None:
        return None
    return tuple(boundaries(torch.as_tensor(cu_seqlens_padded), "cu_seqlens_padded").tolist())


def to_cp(
    routes: Routes, cp_size: int, cp_rank: int, *, cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None
) -> CPRoutes:
    """CP rank `cp_rank`'s part of `routes`, as megatron-core splits the batch for that rank.

    Per sequence (default): [B, T'/CP, L, K] with T' = T padded (unrecorded) to a multiple of 2·`cp_size`. A packed
    row (B = 1, T = `cu_seqlens_padded[-1]`; `to_packed(..., multiple=2 * cp_size)`'s routes know theirs) is split
    per document: [1, T/CP, L, K]. The result knows its place, which the Megatron contexts check.

    Example:
        >>> part = to_cp(routes, cp_size=2, cp_rank=1)  # doctest: +SKIP
        >>> part = to_cp(packed.routes, 2, 1, cu_seqlens_padded=packed.cu_seqlens_padded)  # doctest: +SKIP
    """
    if not isinstance(routes, Routes):
        raise ValueError(f"to_cp needs a Routes, got {type(routes).__name__}")
    if isinstance(routes, CPRoutes):
        raise ValueError(f"these routes are already a part ({routes.where()}): split the whole batch's routes")
    check_cp(cp_size, cp_rank)
    cu = _as_cu(cu_seqlens_padded)
    if isinstance(routes, PackedRoutes):  # a packed row knows its documents
        if cu is not None and cu != routes.cu_seqlens_padded:
            raise ValueError(f"cu_seqlens_padded={list(cu)} was given for {routes.where()}")
        cu = routes.cu_seqlens_padded
    if cu is None:
        full = routes.pad_to(padded_len(routes.seq_len, cp_size))
        idx = cp_positions(full.seq_len, cp_size, cp_rank)
    else:
        if routes.batch_size != 1 or routes.seq_len != cu[-1]:
            raise ValueError(
                f"per-document CP splits one packed row of cu_seqlens_padded[-1] = {cu[-1]} positions, but the routes "
                f"are B={routes.batch_size}, T={routes.seq_len}"
            )
        full, idx = routes, thd_cp_positions(cu, cp_size, cp_rank)
    idx = idx.to(full.device)
    version = None if full.version is None else full.version.index_select(1, idx)
    part = Routes._trusted(full.indices.index_select(1, idx), full.mask.index_select(1, idx), full.layers, version)
    return part_of(part, cp_size, cp_rank, cu)


def from_cp(
    parts: Sequence[Routes],
    seq_len: int | None = None,
    *,
    cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
) -> Routes:
    """The whole `Routes` [B, T, L, K] from every CP rank's part (in rank order), cut to `seq_len` if given (the
    positions beyond it must be unrecorded padding). Parts that know their place (`CPRoutes`, from `to_cp` or a
    recording under CP) must be ranks 0, 1, ... of one layout; plain parts are taken in list order, per sequence
    unless `cu_seqlens_padded` says the row was split per document.

    Example:
        >>> parts = [to_cp(routes, 2, r) for r in range(2)]  # doctest: +SKIP
        >>> whole = from_cp(parts, seq_len=routes.seq_len)  # doctest: +SKIP
    """
    parts = list(parts)
    if not parts:
        raise ValueError("from_cp needs one part per CP rank")
    cp_size, first = len(parts), parts[0]
    cu = _as_cu(cu_seqlens_padded)
    for r, p in enumerate(parts):
        if not isinstance(p, Routes):
            raise ValueError(f"CP rank {r}'s part is a {type(p).__name__}, not a Routes")
        if p.layers != first.layers or p.batch_size != first.batch_size or p.seq_len != first.seq_len:
            raise ValueError(
                f"CP rank {r}'s part has B={p.batch_size}, T={p.seq_len} over {len(p.layers)} layers but rank 0's "
                f"has B={first.batch_size}, T={first.seq_len} over {len(first.layers)}: parts of one batch must agree"
            )
        if isinstance(p, CPRoutes):
            if (p.cp_rank, p.cp_size) != (r, cp_size):
                raise ValueError(f"part {r} of {cp_size} is {p.where()}: pass every rank's part, in rank order")
            if cu is not None and p.cu_seqlens_padded != cu:
                raise ValueError(f"part {r} is {p.where()} but cu_seqlens_padded={list(cu)} was given")
    tagged = [isinstance(p, CPRoutes) for p in parts]
    if any(tagged):
        if not all(tagged) or len({p.cu_seqlens_padded for p in parts}) > 1:
            places = [p.where() if isinstance(p, CPRoutes) else "a plain Routes" for p in parts]
            raise ValueError(f"the parts come from different layouts, or some know their place and some not: {places}")
        cu = first.cu_seqlens_padded
    T = first.seq_len * cp_size
    if cu is not None and cu[-1] != T:
        raise ValueError(
            f"{cp_size} parts of T={first.seq_len} make {T} positions but cu_seqlens_padded ends at {cu[-1]}"
        )
    if cu is None and T % (2 * cp_size):
        raise ValueError(
            f"{cp_size} parts of T={first.seq_len} make {T} positions, not a multiple of 2 x cp_size = {2 * cp_size}: "
            "they are not one batch's per-sequence CP parts"
        )
    B, _, L, K = first.shape
    if len({p.version is None for p in parts}) > 1:
        raise ValueError(f"some CP parts have versions and some not: {[p.version is not None for p in parts]}")
    indices = first.indices.new_zeros((B, T, L, K))
    mask = first.mask.new_zeros((B, T))
    version = None if first.version is None else first.version.new_zeros((B, T))
    for r, p in enumerate(parts):
        idx = (cp_positions(T, cp_size, r) if cu is None else thd_cp_positions(cu, cp_size, r)).to(first.device)
        indices[:, idx], mask[:, idx] = p.indices, p.mask
        if version is not None:
            version[:, idx] = p.version
    if seq_len is not None:
        if not is_integer_scalar(seq_len) or seq_len < 0:
            raise ValueError(f"seq_len must be a whole number >= 0, got {seq_len!r}")
        if seq_len > T or mask[:, seq_len:].any():
            raise ValueError(f"cannot cut routes of T={T} to seq_len={seq_len}: recorded positions lie beyond it")
        indices, mask = indices[:, :seq_len], mask[:, :seq_len]
        version = None if version is None else version[:, :seq_len]
    return Routes._trusted(indices, mask, first.layers, version)

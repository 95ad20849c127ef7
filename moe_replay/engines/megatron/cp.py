"""Megatron's context-parallel sequence layout and `Routes`, both ways.

With context parallelism (CP) megatron-core splits each sequence into 2·CP equal chunks and gives CP rank r chunks r
and 2·CP − 1 − r, concatenated (`get_batch_on_this_cp_rank`: balanced causal attention work), so a sequence's length
must be a multiple of 2·CP. `routes_to_cp` gives a rank its part of a `Routes` [B, T, L, K] in that layout (T padded
with unrecorded positions to a multiple of 2·CP); `routes_from_cp` puts the ranks' parts back together.

Shape legend: B sequences, T positions, L layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...routes import Routes
from ...routes_index import is_integer_scalar


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


def routes_to_cp(routes: Routes, cp_size: int, cp_rank: int) -> Routes:
    """CP rank `cp_rank`'s part of `routes` [B, T, L, K]: [B, T'/CP, L, K] with T' = T padded (unrecorded) to a
    multiple of 2·`cp_size`, positions in the rank's layout.

    Example:
        >>> part = routes_to_cp(routes, cp_size=2, cp_rank=1)  # doctest: +SKIP
    """
    if not isinstance(routes, Routes):
        raise ValueError(f"routes_to_cp needs a Routes, got {type(routes).__name__}")
    check_cp(cp_size, cp_rank)
    full = routes.pad_to(padded_len(routes.seq_len, cp_size))
    idx = cp_positions(full.seq_len, cp_size, cp_rank).to(full.device)
    return Routes._trusted(full.indices.index_select(1, idx), full.mask.index_select(1, idx), full.layers)


def routes_from_cp(parts: Sequence[Routes], seq_len: int | None = None) -> Routes:
    """The whole `Routes` [B, T, L, K] from every CP rank's part (in rank order), cut to `seq_len` if given (the
    positions beyond it must be unrecorded padding).

    Example:
        >>> parts = [routes_to_cp(routes, 2, r) for r in range(2)]  # doctest: +SKIP
        >>> whole = routes_from_cp(parts, seq_len=routes.seq_len)  # doctest: +SKIP
    """
    parts = list(parts)
    if not parts:
        raise ValueError("routes_from_cp needs one part per CP rank")
    cp_size, first = len(parts), parts[0]
    for r, p in enumerate(parts):
        if not isinstance(p, Routes):
            raise ValueError(f"CP rank {r}'s part is a {type(p).__name__}, not a Routes")
        if p.layers != first.layers or p.batch_size != first.batch_size or p.seq_len != first.seq_len:
            raise ValueError(
                f"CP rank {r}'s part has B={p.batch_size}, T={p.seq_len} over {len(p.layers)} layers but rank 0's "
                f"has B={first.batch_size}, T={first.seq_len} over {len(first.layers)}: parts of one batch must agree"
            )
    T = first.seq_len * cp_size
    B, _, L, K = first.shape
    indices = first.indices.new_zeros((B, T, L, K))
    mask = first.mask.new_zeros((B, T))
    for r, p in enumerate(parts):
        idx = cp_positions(T, cp_size, r).to(first.device)
        indices[:, idx], mask[:, idx] = p.indices, p.mask
    if seq_len is not None:
        if not is_integer_scalar(seq_len) or seq_len < 0:
            raise ValueError(f"seq_len must be a whole number >= 0, got {seq_len!r}")
        if seq_len > T or mask[:, seq_len:].any():
            raise ValueError(f"cannot cut routes of T={T} to seq_len={seq_len}: recorded positions lie beyond it")
        indices, mask = indices[:, :seq_len], mask[:, :seq_len]
    return Routes._trusted(indices, mask, first.layers)

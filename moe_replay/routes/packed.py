"""Packed sequences (the THD layout): a batch's sequences concatenated in one row, as Megatron (`PackedSeqParams`)
and padding-free Hugging Face training run them, and `Routes` [B, T] both ways.

A batch row's tokens are the positions its attention mask keeps (left or right padding alike); packed, sequence i
takes positions `cu_seqlens_padded[i]` to `cu_seqlens_padded[i] + n_i` of the row, followed by unrecorded padding up to
`cu_seqlens_padded[i + 1]` (each sequence padded to a multiple of `multiple`: Megatron's 2·CP under context
parallelism, 1 otherwise).

Shape legend: B sequences, T positions, N packed positions, L layers, K experts per token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .core import Routes
from .index import is_integer_scalar
from .placed import PlacedRoutes


class PackedRoutes(PlacedRoutes):
    """A packed row's routes [1, N, L, K] that know their sequences' boundaries (`cu_seqlens`, and
    `cu_seqlens_padded` where each sequence starts): `replay_routes` replays them only on a forward that runs the
    row as those packed sequences, and `to_cp` splits them per document.

    Example:
        >>> to_packed(routes, attention_mask).routes.cu_seqlens  # doctest: +SKIP
        (0, 5, 12)
    """

    PLACE = ("cu_seqlens", "cu_seqlens_padded")
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]

    def where(self) -> str:
        """The place in words, for messages."""
        return f"packed sequences starting at {list(self.cu_seqlens_padded[:-1])}"


class Packed(NamedTuple):
    """`to_packed`' result: the packed routes [1, N, L, K] (a `PackedRoutes`) and the int32 [B + 1] boundaries that
    Megatron's `PackedSeqParams` takes (`cu_seqlens_q` / `cu_seqlens_q_padded`)."""

    routes: PackedRoutes
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor


def token_mask(
    attention_mask: torch.Tensor, device: torch.device, shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """`attention_mask` [B, T] as bool on `device`, checked (0/1 integers or bools, never floats, which a 0.5 would
    pass as real; the routes' (B, T) when `shape` is given).

    Example:
        >>> token_mask(torch.tensor([[0, 1, 1]]), torch.device("cpu")).tolist()
        [[False, True, True]]
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a [B, T] tensor, got {got}")
    if shape is not None and tuple(attention_mask.shape) != shape:
        raise ValueError(
            f"attention_mask is {tuple(attention_mask.shape)} but the routes are B={shape[0]}, T={shape[1]}"
        )
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(f"attention_mask must hold 0/1 integers or bools, got {attention_mask.dtype}")
    values = attention_mask.to(device)
    if values.dtype != torch.bool and ((values < 0) | (values > 1)).any():
        raise ValueError("attention_mask must hold only 0 and 1")
    return values != 0


def to_packed(routes: Routes, attention_mask: torch.Tensor, *, multiple: int = 1) -> Packed:
    """Pack a batch's routes [B, T, L, K] into one row [1, N, L, K]: each row's tokens (where `attention_mask` [B, T]
    is 1) in order, each sequence padded with unrecorded positions to a multiple of `multiple`.

    Example:
        >>> packed = to_packed(routes, attention_mask, multiple=2 * cp_size)  # doctest: +SKIP
        >>> PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, ...)  # doctest: +SKIP
    """
    if not isinstance(routes, Routes):
        raise ValueError(f"to_packed needs a Routes, got {type(routes).__name__}")
    if not is_integer_scalar(multiple) or multiple < 1:
        raise ValueError(f"multiple must be a whole number >= 1, got {multiple!r}")
    keep = token_mask(attention_mask, routes.device, (routes.batch_size, routes.seq_len))
    stray = routes.mask & ~keep
    if stray.any():
        b, t = (int(x) for x in stray.nonzero()[0])
        raise ValueError(f"sequence {b} has a route recorded at position {t}, which its attention_mask marks padding")
    lengths = keep.sum(1).cpu()
    padded = -(-lengths // multiple) * multiple
    cu = torch.zeros(routes.batch_size + 1, dtype=torch.int32)
    cu_padded = cu.clone()
    cu[1:], cu_padded[1:] = lengths.cumsum(0), padded.cumsum(0)
    N, (_, _, L, K) = int(cu_padded[-1]), routes.shape
    indices = routes.indices.new_zeros((1, N, L, K))
    mask = routes.mask.new_zeros((1, N))
    at = _packed_positions(cu_padded, lengths).to(routes.device)
    indices[0, at], mask[0, at] = routes.indices[keep], routes.mask[keep]
    version = None if routes.version is None else routes.version.new_zeros((1, N))
    if version is not None:
        version[0, at] = routes.version[keep]
    packed = PackedRoutes.placed(
        Routes._trusted(indices, mask, routes.layers, version),
        cu_seqlens=tuple(cu.tolist()),
        cu_seqlens_padded=tuple(cu_padded.tolist()),
    )
    return Packed(packed, cu, cu_padded)


def from_packed(
    packed: Routes,
    cu_seqlens: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
) -> Routes:
    """The batch [B, T, L, K] of a packed row `packed` [1, N, L, K]: sequence i's `cu_seqlens` length of tokens,
    starting at `cu_seqlens_padded[i]` (default `cu_seqlens`), go to the positions row i of `attention_mask` [B, T]
    keeps; routes in the padding between sequences (a recording on the packed row routes its padding tokens too) are
    dropped. Raise ValueError when the boundaries do not match the mask's lengths or the row, or (`PackedRoutes`,
    which know their own) differ from the routes' own boundaries.

    Example:
        >>> routes = from_packed(packed.routes, packed.cu_seqlens, attention_mask,
        ...                        cu_seqlens_padded=packed.cu_seqlens_padded)  # doctest: +SKIP
    """
    if not isinstance(packed, Routes) or packed.batch_size != 1:
        what = f"B={packed.batch_size}" if isinstance(packed, Routes) else type(packed).__name__
        raise ValueError(f"from_packed needs packed Routes of one row (B=1), got {what}")
    keep = token_mask(attention_mask, packed.device)
    B, T = keep.shape
    lengths = keep.sum(1).cpu()
    cu = boundaries(torch.as_tensor(cu_seqlens), "cu_seqlens", B)
    if isinstance(packed, PackedRoutes):  # the packed row knows its boundaries: any given must be the same
        for name, own, value in (
            ("cu_seqlens", packed.cu_seqlens, cu),
            ("cu_seqlens_padded", packed.cu_seqlens_padded, cu_seqlens_padded),
        ):
            found = None if value is None else tuple(boundaries(torch.as_tensor(value), name).tolist())
            if found is not None and found != own:
                raise ValueError(f"{name}={list(found)} was given for {packed.where()}, whose {name} are {list(own)}")
        cu_seqlens_padded = packed.cu_seqlens_padded
    given = cu_seqlens_padded is not None
    cu_padded = boundaries(torch.as_tensor(cu_seqlens_padded), "cu_seqlens_padded", B) if given else cu
    own = cu[1:] - cu[:-1]
    if not torch.equal(own, lengths):
        i = int((own != lengths).nonzero()[0])
        raise ValueError(
            f"sequence {i}: cu_seqlens give {int(own[i])} tokens but its attention_mask row keeps {int(lengths[i])}"
        )
    room = cu_padded[1:] - cu_padded[:-1]
    if (room < own).any() or int(cu_padded[-1]) > packed.seq_len:
        raise ValueError(
            f"cu_seqlens_padded {cu_padded.tolist()} do not hold the sequences' lengths {own.tolist()} within the "
            f"packed row of N={packed.seq_len}"
        )
    at = _packed_positions(cu_padded, lengths).to(packed.device)
    indices = packed.indices.new_zeros((B, T) + packed.shape[2:])
    mask = packed.mask.new_zeros((B, T))
    indices[keep], mask[keep] = packed.indices[0, at], packed.mask[0, at]
    version = None if packed.version is None else packed.version.new_zeros((B, T))
    if version is not None:
        version[keep] = packed.version[0, at]
    return Routes._trusted(indices, mask, packed.layers, version)


def boundaries(cu: torch.Tensor, what: str, sequences: int | None = None) -> torch.Tensor:
    """`cu` (cumulative sequence boundaries) as an int64 CPU tensor, checked: 1-D, whole numbers from 0, never
    decreasing, and `sequences` + 1 long when given.

    Example:
        >>> boundaries(torch.tensor([0, 3, 8]), "cu_seqlens", 2).tolist()
        [0, 3, 8]
    """
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(f"{what} must be a 1-D integer tensor, got {getattr(cu, 'dtype', type(cu).__name__)}")
    cu = cu.detach().cpu().long()
    if sequences is not None and cu.numel() != sequences + 1:
        raise ValueError(f"{what} has {cu.numel()} entries but {sequences} sequences need {sequences + 1}")
    if cu.numel() == 0 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{what} must start at 0 and never decrease, got {cu.tolist()}")
    return cu


def _packed_positions(cu_padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The packed positions that hold tokens, sequence after sequence: cu_padded[i] + 0..lengths[i]-1."""
    starts = cu_padded[:-1].long().repeat_interleave(lengths)
    offsets = torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
    return starts + offsets

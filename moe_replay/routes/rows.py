"""`from_rows` (`Routes.from_rows`): one array of routes per sequence (as inference engines return them) laid out as a
[B, T] batch. These per-sequence rows are what "rows" means in `moe_replay.routes`; Megatron's one tensor per layer
are "layer rows" (`moe_replay.engines.megatron.from_layer_rows`).

Engines name no layers and return one column per *decoder* layer (`num_hidden_layers`, dense layers included) or
one per MoE layer; the caller's `LayerInfo`s name the MoE layers and `columns` says which engine column each takes.

Shape legend: B sequences, T positions, L MoE layers, C engine columns, K experts per token, n_i rows of sequence i.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from numbers import Real
from typing import Any

import numpy as np
import torch

from .check import check_ids
from .core import Routes
from .index import is_integer_scalar
from .layers import LayerInfo, check_layers, index_dtype

DECODER_INDEX = re.compile(r"(?:^|\.)(?<!mtp\.)layers\.(\d+)\.")  # (not a multi-token-prediction layer's)


def decoder_index(name: str) -> int | None:
    """The decoder-layer number in a router's module name (`model.layers.3.mlp.gate` -> 3), or None.

    Example:
        >>> decoder_index("model.layers.3.mlp.gate"), decoder_index("decoder.layers.11.mlp.router")
        (3, 11)
    """
    found = DECODER_INDEX.findall(name)
    return int(found[-1]) if found else None


def engine_columns(layers: Sequence[LayerInfo], num_columns: int) -> list[int]:
    """Which of an engine's `num_columns` columns each layer takes: column i by position when there is one column per
    layer; otherwise the decoder-layer number in each layer's name (one column per decoder layer).

    Example:
        >>> engine_columns([LayerInfo("model.layers.0.mlp.gate", 8, 2), LayerInfo("model.layers.2.mlp.gate", 8, 2)], 3)
        [0, 2]
    """
    if num_columns == len(layers):
        return list(range(num_columns))
    found = [decoder_index(layer.name) for layer in layers]
    if None in found:
        raise ValueError(
            f"the engine returned {num_columns} layer columns for {len(layers)} MoE layers, and layer "
            f"{layers[found.index(None)].name!r} names no decoder layer ('layers.<i>.') to map it to a column"
        )
    if max(found) >= num_columns:
        raise ValueError(
            f"layer {layers[found.index(max(found))].name!r} is decoder layer {max(found)} but the engine returned "
            f"{num_columns} layer columns"
        )
    twice = next((c for c in found if found.count(c) > 1), None)
    if twice is not None:
        names = [layer.name for layer, c in zip(layers, found, strict=True) if c == twice]
        raise ValueError(
            f"layers {names} all name decoder layer {twice}, whose one engine column cannot hold both: pass "
            "`columns` to say which column each layer takes"
        )
    return found


def as_tensor(row: Any) -> torch.Tensor:
    """A row of routes as a CPU tensor without a copy where possible (numpy arrays, tensors, nested lists).

    Example:
        >>> as_tensor(np.zeros((2, 1, 2), dtype=np.uint16)).dtype
        torch.int32
    """
    if isinstance(row, torch.Tensor):
        row = row.cpu()  # routes are laid out on the host (rows on an accelerator are copied once)
        if row.dtype == torch.uint64:
            return as_tensor(row.numpy())  # (checked as numpy's: ids of 2**63 and up would turn negative)
        # torch reads its wider unsigned dtypes for a few ops only: widened (expert ids fit int64)
        return row.long() if row.dtype in (torch.uint16, torch.uint32) else row
    if not isinstance(row, np.ndarray):
        try:
            row = np.asarray(row)
        except ValueError as e:  # (ragged nested lists)
            raise ValueError(f"expected integer routes [n, C, K], got nested lists numpy cannot read: {e}") from None
    if row.dtype.kind not in "iub":  # (bool is refused by the caller, naming the row)
        raise ValueError(f"expected integer routes [n, C, K], got {row.shape} {row.dtype}")
    if row.dtype.kind == "u" and row.dtype.itemsize == 8 and row.size and int(row.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"expert id {int(row.max())} outside int64 (and any layer's experts)")
    if row.dtype.kind == "u" and row.dtype.itemsize > 1:  # (likewise; ids < 65536 fit int32)
        row = row.astype(np.int32 if row.dtype.itemsize == 2 else np.int64)
    elif not row.dtype.isnative:  # (an .npy written big-endian)
        row = row.astype(row.dtype.newbyteorder("="))
    row = np.ascontiguousarray(row)
    with warnings.catch_warnings():  # a read-only buffer (np.frombuffer of a payload): it is only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(row)


def layer_range(picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, the smallest and largest id of `picked` [n, L, K] (contiguous reductions over [n, L·K]).

    Example:
        >>> [t.tolist() for t in layer_range(torch.tensor([[[0, 3], [1, 2]]]))]
        [[0, 1], [3, 2]]
    """
    n, L, K = picked.shape
    flat = picked.reshape(n, L * K)
    lo = flat.amin(0).reshape(L, K).amin(1) if picked.dtype.is_signed else torch.zeros(L, dtype=picked.dtype)
    return lo, flat.amax(0).reshape(L, K).amax(1)


def empty_positions(picked: torch.Tensor, zeros_empty: bool) -> torch.Tensor:
    """bool [n]: positions of `picked` [n, L, K] whose ids are all negative, or (with `zeros_empty`) all zero.

    Example:
        >>> empty_positions(torch.tensor([[[-1, -1]], [[0, 0]], [[0, 1]]]), zeros_empty=True).tolist()
        [True, True, False]
    """
    empty = (picked < 0).flatten(1).all(1)
    if zeros_empty:
        empty |= (picked == 0).flatten(1).all(1)
    return empty


def pad_offsets(pad_left: Sequence[int] | torch.Tensor | None, rows: int) -> list[int]:
    """`pad_left` as one int offset per row (default 0), or a ValueError naming both counts.

    Example:
        >>> pad_offsets(torch.tensor([2, 0]), 2), pad_offsets(None, 3)
        ([2, 0], [0, 0, 0])
    """
    if torch.is_tensor(pad_left) or isinstance(pad_left, np.ndarray):
        pad_left = pad_left.tolist()
    if pad_left is not None:
        pad_left = list(pad_left)
        whole = [isinstance(p, Real) and not isinstance(p, bool) and p == p and float(p).is_integer() for p in pad_left]
        if not all(whole):
            raise ValueError(f"pad_left must hold whole numbers of positions, got {pad_left}")
    pads = [0] * rows if pad_left is None else [int(p) for p in pad_left]
    if len(pads) != rows:
        raise ValueError(f"pad_left has {len(pads)} offsets for {rows} rows")
    return pads


def from_rows(
    rows: Sequence[Any],
    layers: Sequence[LayerInfo],
    *,
    pad_left: Sequence[int] | torch.Tensor | None = None,
    seq_len: int | None = None,
    columns: Sequence[int] | None = None,
    zeros_empty: bool = False,
) -> Routes:
    """What `Routes.from_rows` does: row i ([n_i, C, K]) lands at positions pad_left[i] .. pad_left[i] + n_i - 1 of
    a [B, T] batch (mask True there); the columns of `columns` (default: `engine_columns`) become the L layers.
    Ids are range-checked in the engine's dtype before they are narrowed, then checked for duplicates. A position
    whose ids are all negative (an engine's "no route" sentinel), or with `zeros_empty` all zero (K > 1: never a
    real route, whose K ids are distinct), is left unrecorded.

    Example:
        >>> from_rows([torch.tensor([[[0, 1]]])], [LayerInfo("model.layers.0.mlp.gate", 4, 2)], pad_left=[1]).mask
        tensor([[False,  True]])
    """
    rows = list(rows)
    layers = tuple(layers)
    B = len(rows)
    if not layers:
        raise ValueError("Routes.from_rows needs at least one LayerInfo")
    K = getattr(layers[0], "top_k", None)
    check_layers(layers, K, f"layer {getattr(layers[0], 'name', None)!r} has top_k={K}")
    pads = pad_offsets(pad_left, B)
    tensors = []
    for i, r in enumerate(rows):
        try:
            tensors.append(as_tensor(r))
        except ValueError as e:
            raise ValueError(f"row {i}: {e}") from None
    for i, t in enumerate(tensors):
        if t.dim() != 3 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"row {i}: expected integer routes [n, C, K], got {tuple(t.shape)} {t.dtype}")
    for i, t in enumerate(tensors):
        if t.shape[2] != K:
            raise ValueError(f"row {i} holds K={t.shape[2]} experts per token but the layers have top_k={K}")
    shapes = {t.shape[1] for t in tensors if t.shape[0] > 0}
    if len(shapes) > 1:
        raise ValueError(f"rows disagree on their number of layer columns: {sorted(shapes)}")
    C = next(iter(shapes)) if shapes else len(layers)
    cols = list(columns) if columns is not None else engine_columns(layers, C)
    if not all(map(is_integer_scalar, cols)):
        raise ValueError(f"columns must be whole numbers (engine column indices), got {cols}")
    if len(cols) != len(layers):
        raise ValueError(f"{len(cols)} columns given for {len(layers)} layers")
    if any(not 0 <= c < C for c in cols):
        raise ValueError(f"columns {cols} name columns outside the rows' {C} layer columns (0..{C - 1})")
    if seq_len is not None and (not is_integer_scalar(seq_len) or seq_len < 0):
        raise ValueError(f"seq_len must be a whole number >= 0, got {seq_len!r}")
    ends = [p + t.shape[0] for p, t in zip(pads, tensors, strict=True)]
    T = max(ends, default=0) if seq_len is None else int(seq_len)
    if min(pads, default=0) < 0 or max(ends, default=0) > T:
        i = max(range(B), key=lambda j: ends[j]) if max(ends, default=0) > T else min(range(B), key=lambda j: pads[j])
        raise ValueError(f"row {i} ({tensors[i].shape[0]} positions from offset {pads[i]}) does not fit T={T}")
    dtype = index_dtype(max(layer.num_experts for layer in layers))
    experts = torch.tensor([layer.num_experts for layer in layers])
    indices = torch.zeros(B, T, len(layers), K, dtype=dtype)
    mask = torch.zeros(B, T, dtype=torch.bool)
    select = torch.tensor(cols)
    for i, (p, t) in enumerate(zip(pads, tensors, strict=True)):
        n = t.shape[0]
        if n == 0:
            continue
        picked = t if cols == list(range(C)) else t.index_select(1, select)  # [n, L, K], engine dtype
        lo, hi = layer_range(picked)
        keep = None
        zeros = zeros_empty and K > 1  # (at K = 1 zero in every layer is a real route too)
        if zeros or bool((lo < 0).any()):
            keep = ~empty_positions(picked, zeros)  # [n]: positions the engine returned nothing real for
            if not keep.any():
                continue  # (a row with no real route: nothing recorded)
            if not keep.all():
                lo, hi = layer_range(picked[keep])
        bad = (lo < 0) | (hi.long() >= experts)
        if bad.any():
            j = int(bad.nonzero()[0])
            value = int(lo[j]) if int(lo[j]) < 0 else int(hi[j])
            raise ValueError(
                f"row {i}, layer {layers[j].name!r} (engine column {cols[j]}): expert id {value} outside "
                f"[0, E={layers[j].num_experts})"
            )
        indices[i, p : p + n] = picked if keep is None else picked.clamp(min=0)
        mask[i, p : p + n] = True if keep is None else keep
    check_ids(indices, mask, layers)
    return Routes._trusted(indices, mask, layers)

"""Megatron's layer rows and `Routes`: per layer one int64 [s·b, K] tensor, rows sequence-major
(`row = s_idx * b + b_idx`, the layout of a router's [s, b, h] input), against `Routes` [B, T, L, K]. (Not the
per-sequence rows of inference engines, `Routes.from_rows`: one [n_i, C, K] array per sequence.)

Example:
    >>> from moe_replay.engines.megatron import from_layer_rows, to_layer_rows  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...deprecation import moved
from ...routes import LayerInfo, Routes
from ...routes.index import is_integer_scalar


def from_layer_rows(rows: Sequence[torch.Tensor], batch_size: int, layers: Sequence[LayerInfo]) -> Routes:
    """Megatron's per-layer top-k rows (each [S·B, K], row `s * B + b`) as `Routes` [B, S, L, K], all recorded.

    Example:
        >>> rows = [torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])]  # S=2, B=2, K=2: rows s0b0, s0b1, s1b0, s1b1
        >>> routes = from_layer_rows(rows, batch_size=2, layers=[LayerInfo("layer0", 4, 2)])
        >>> routes.indices[1, 0, 0].tolist()  # sequence 1, position 0
        [2, 3]
    """
    rows, layers = list(rows), list(layers)
    if len(rows) != len(layers):
        raise ValueError(f"got {len(rows)} row tensors for {len(layers)} layers")
    for layer, r in zip(layers, rows, strict=True):
        if not isinstance(r, torch.Tensor) or r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool:
            got = r.dtype if isinstance(r, torch.Tensor) else type(r).__name__
            raise ValueError(f"layer {layer.name!r}: rows must be an integer tensor [S*B, K], got {got}")
    shapes = {tuple(r.shape) for r in rows}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"all layers must have the same [S*B, K] rows, got shapes {sorted(shapes)}")
    n, k = next(iter(shapes))
    if not is_integer_scalar(batch_size) or batch_size < 1 or n % batch_size:
        raise ValueError(f"{n} rows do not split into batch_size={batch_size!r} sequences")
    # [B, S, K] per layer, stacked in the rows' own dtype (torch reads its wider unsigned dtypes for few ops:
    # widened): `Routes` range-checks the ids as given before it narrows them to its index dtype
    wide = [r.long() if r.dtype in (torch.uint16, torch.uint32, torch.uint64) else r for r in rows]
    per_layer = [r.reshape(n // batch_size, batch_size, k).transpose(0, 1) for r in wide]
    indices = torch.stack(per_layer, dim=2)
    mask = torch.ones(indices.shape[:2], dtype=torch.bool, device=indices.device)
    return Routes(indices, mask, layers)


def to_layer_rows(routes: Routes) -> list[torch.Tensor]:
    """`Routes` [B, T, L, K] as Megatron's per-layer int64 rows [T·B, K] (row `t * B + b`), e.g. for
    `RouterReplay.set_replay_data`. Positions the routes did not record get distinct experts spread evenly over
    the experts (never all the same one); `replay_routes` routes them live instead.

    Example:
        >>> rows = to_layer_rows(routes)  # doctest: +SKIP
        >>> len(rows), rows[0].shape  # L tensors of [T*B, K]  # doctest: +SKIP
    """
    B, T, L, K = routes.indices.shape
    rows = routes.indices.transpose(0, 1).reshape(T * B, L, K).long()
    counts = torch.tensor([max(info.num_experts, K) for info in routes.layers], device=rows.device)
    order = torch.arange(T * B, device=rows.device)[:, None, None] * K + torch.arange(K, device=rows.device)
    spread = order % counts[:, None]  # [T*B, L, K]
    keep = routes.mask.transpose(0, 1).reshape(T * B, 1, 1).to(rows.device)
    return list(torch.where(keep, rows, spread).unbind(1))


# deprecated names, one release: each read warns and names its new place
__getattr__ = moved(
    __name__,
    renamed={
        "rows_to_routes": "moe_replay.engines.megatron.rows.from_layer_rows",
        "routes_to_rows": "moe_replay.engines.megatron.rows.to_layer_rows",
    },
)

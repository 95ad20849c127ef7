"""`Routes`: the experts every token was sent to, in every MoE layer, and their layouts.

One module a job:

    core.py      Routes [B, T, L, K] with its mask [B, T]: build, select, join, pad, compare, save / load
    layers.py    LayerInfo (one router's name, E and K), the id dtype for E, layer-list checks
    check.py     the per-id check (ids in [0, E), distinct per token and layer) and the version check
    index.py     batch indices: which sequences `routes[idx]` selects
    io.py        the safetensors file format (`Routes.save` / `Routes.load`)
    rows.py      `from_rows`: one array per sequence, as inference engines return them (`Routes.from_rows`)
    placed.py    PlacedRoutes: routes that know where they sit in a larger layout
    packed.py    PackedRoutes: a batch packed into one row (THD), `to_packed` / `from_packed`
    cp.py        CPRoutes: a context-parallel rank's part, `to_cp` / `from_cp`
    segments.py  multi-turn and partial rollouts: `assemble_routes` from `Segment`s, `fresh`

Conversions between `Routes` and another layout are named `to_<layout>` (from `Routes`) and `from_<layout>` (to
`Routes`). This package imports nothing of moe_replay above it but `errors`.

Example:
    >>> import torch
    >>> from moe_replay.routes import LayerInfo, Routes, to_packed
    >>> r = Routes(torch.tensor([[[[0, 1]], [[2, 3]]]]), torch.tensor([[True, True]]), [LayerInfo("l0", 4, 2)])
    >>> to_packed(r, torch.tensor([[1, 1]])).cu_seqlens.tolist()
    [0, 2]
"""

from .check import check_ids, check_version
from .core import IndexLike, Routes, check_structure
from .cp import CPRoutes, cp_positions, from_cp, thd_cp_positions, to_cp
from .index import batch_index, is_integer_scalar
from .layers import LayerInfo, check_layers, index_dtype, layer_diff
from .packed import Packed, PackedRoutes, from_packed, to_packed
from .placed import PlacedRoutes
from .rows import from_rows
from .segments import Segment, assemble_routes, fresh

__all__ = [
    "CPRoutes",
    "IndexLike",
    "LayerInfo",
    "Packed",
    "PackedRoutes",
    "PlacedRoutes",
    "Routes",
    "Segment",
    "assemble_routes",
    "batch_index",
    "check_ids",
    "check_layers",
    "check_structure",
    "check_version",
    "cp_positions",
    "fresh",
    "from_cp",
    "from_packed",
    "from_rows",
    "index_dtype",
    "is_integer_scalar",
    "layer_diff",
    "thd_cp_positions",
    "to_cp",
    "to_packed",
]

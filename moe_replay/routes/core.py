"""`Routes`: the experts every token was sent to, in every MoE layer.

Shape legend: B sequences, T token positions, L MoE layers, E experts, K top-k.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from .check import check_ids, check_version
from .index import batch_index
from .layers import LayerInfo, check_layers, index_dtype, layer_diff

IndexLike = int | slice | Sequence[int] | torch.Tensor


class Routes:
    """The top-k experts chosen for each token and MoE layer, with a mask of the positions that were recorded.

    `indices` is [B, T, L, K] in the smallest integer dtype that holds E; `mask` is bool [B, T], True where a
    route was recorded (position t is the decision made when token t was the model's input; padding and the
    last sampled token have none). The K experts of a (token, layer) are a set: their order is whatever the
    router returned. `version` (optional, int32 [B, T]) is the policy version whose forward produced each recorded
    position (`assemble_routes` sets it; `fresh` bounds its age). Values at masked positions are meaningless.

    Example:
        >>> r = Routes(torch.tensor([[[[0, 1]], [[2, 3]]]]), torch.tensor([[True, False]]),
        ...            [LayerInfo("model.layers.0.mlp.gate", 4, 2)])
        >>> r.shape, r.indices.dtype
        ((1, 2, 1, 2), torch.uint8)
        >>> r[[0, 0]].shape
        (2, 2, 1, 2)
    """

    def __init__(
        self,
        indices: torch.Tensor,
        mask: torch.Tensor,
        layers: Sequence[LayerInfo],
        version: torch.Tensor | None = None,
    ) -> None:
        layers = check_structure(indices, mask, layers)
        check_ids(indices, mask, layers)
        dtype = index_dtype(max((layer.num_experts for layer in layers), default=1))
        self.indices = indices if indices.dtype == dtype else indices.to(dtype)
        self.mask = mask
        self.layers = layers
        self.version = check_version(version, mask)

    # ---- shape ---------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, T, L, K)."""
        return tuple(self.indices.shape)  # type: ignore[return-value]

    @property
    def batch_size(self) -> int:
        return self.indices.shape[0]

    @property
    def seq_len(self) -> int:
        return self.indices.shape[1]

    @property
    def top_k(self) -> int:
        return self.indices.shape[3]

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def device(self) -> torch.device:
        return self.indices.device

    @property
    def nbytes(self) -> int:
        """Bytes held by `indices` and `mask` (K bytes per (token, layer) at <= 256 experts, plus 1 per token)."""
        return self.indices.nelement() * self.indices.element_size() + self.mask.nelement() * self.mask.element_size()

    def __len__(self) -> int:
        return self.batch_size

    def __repr__(self) -> str:
        B, T, L, K = self.shape
        es = sorted({layer.num_experts for layer in self.layers})
        return (
            f"Routes(B={B}, T={T}, L={L}, K={K}, E={es[0] if len(es) == 1 else es}, dtype={self.indices.dtype}, "
            f"recorded={int(self.mask.sum())} positions, device={self.device})"
        )

    # ---- slicing and joining -------------------------------------------------------------------------------
    def __getitem__(self, idx: IndexLike) -> Routes:
        """Select sequences (a minibatch) as tensor indexing along B would; an int keeps the batch dim (B=1).

        `idx` is an int, a slice, a 1-D list, tensor or numpy array of ids, or a bool mask of length B; an empty
        list gives an empty batch (B=0).
        """
        idx = batch_index(idx, self.batch_size, self.device)
        version = None if self.version is None else self.version[idx]
        return Routes._trusted(self.indices[idx], self.mask[idx], self.layers, version)

    @classmethod
    def cat(cls, parts: Sequence[Routes]) -> Routes:
        """Concatenate along the batch; shorter parts are right-padded with masked positions.

        Example:
            >>> both = Routes.cat([routes_a, routes_b])  # doctest: +SKIP
        """
        parts = list(parts)
        if not parts:
            raise ValueError("Routes.cat needs at least one Routes")
        first = parts[0]
        for p in parts[1:]:
            if p.layers != first.layers:
                raise ValueError(
                    f"cannot concatenate Routes over different layers: {layer_diff(first.layers, p.layers)}"
                )
            if p.device != first.device:
                raise ValueError(f"cannot concatenate Routes on {first.device} and {p.device}")
        versioned = [p.version is not None for p in parts]
        if any(versioned) and not all(versioned):
            raise ValueError(f"cannot concatenate Routes with and without versions (versioned: {versioned})")
        T = max(p.seq_len for p in parts)
        indices = torch.cat([_pad_t(p.indices, T) for p in parts])
        mask = torch.cat([_pad_t(p.mask, T) for p in parts])
        version = torch.cat([_pad_t(p.version, T) for p in parts]) if all(versioned) else None
        return Routes._trusted(indices, mask, first.layers, version)  # (a join of placed routes has no single place)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Any],
        layers: Sequence[LayerInfo],
        *,
        pad_left: Sequence[int] | torch.Tensor | None = None,
        seq_len: int | None = None,
        columns: Sequence[int] | None = None,
        zeros_empty: bool = False,
    ) -> Routes:
        """Build from one [n_i, C, K] array per sequence (torch, numpy or nested lists, in any integer dtype) for
        its positions 0..n_i-1, placed from its left-padding offset `pad_left[i]` in a [B, T] batch (T = `seq_len`,
        default the longest); other positions are unrecorded. `layers` name the L MoE layers; `columns` says which
        of the C columns each takes (default: by position when C == L, else the decoder-layer number in each
        name, for engines that return one column per decoder layer). Ids are checked (in [0, E), distinct).

        Example:
            >>> rows = [torch.tensor([[[0, 1]], [[2, 3]]]), torch.tensor([[[1, 2]]])]
            >>> Routes.from_rows(rows, [LayerInfo("model.layers.0.mlp.gate", 4, 2)], pad_left=[0, 1]).mask.tolist()
            [[True, True], [False, True]]
        """
        from .rows import from_rows

        return from_rows(rows, layers, pad_left=pad_left, seq_len=seq_len, columns=columns, zeros_empty=zeros_empty)

    def to(self, device: torch.device | str) -> Routes:
        """Move to a device (indices keep their dtype)."""
        version = None if self.version is None else self.version.to(device)  # (`device` may be an int)
        return Routes._trusted(self.indices.to(device), self.mask.to(device), self.layers, version)

    def pad_to(self, seq_len: int) -> Routes:
        """Right-pad the positions to `seq_len` with masked (unrecorded) positions."""
        if seq_len < self.seq_len:
            raise ValueError(f"cannot pad Routes of T={self.seq_len} to a shorter T={seq_len}")
        version = None if self.version is None else _pad_t(self.version, seq_len)
        return Routes._trusted(_pad_t(self.indices, seq_len), _pad_t(self.mask, seq_len), self.layers, version)

    def equal(self, other: Routes) -> bool:
        """True when both hold the same layers, mask, the same expert sets and versions (or none) at every recorded
        position."""
        if self.layers != other.layers or self.shape != other.shape or not torch.equal(self.mask, other.mask):
            return False
        if (self.version is None) != (other.version is None):
            return False
        if self.version is not None and not torch.equal(self.version[self.mask], other.version[other.mask]):
            return False
        a = self.indices.long().sort(-1).values[self.mask]
        b = other.indices.long().sort(-1).values[other.mask]
        return torch.equal(a, b)

    # ---- files ---------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write to a safetensors file with a JSON header (format, version, layers).

        Example:
            >>> routes.save("r.safetensors"); Routes.load("r.safetensors")  # doctest: +SKIP
        """
        from .io import save_routes

        save_routes(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu", *, validate: bool = True) -> Routes:
        """Read a file written by `Routes.save`; a truncated, foreign, newer-format or inconsistent file raises
        RoutesFileError.

        `validate=False` skips the per-entry check (ids in [0, E), no duplicates) for files you wrote yourself and
        memory-maps the file; the header, shapes, dtypes and layers are always checked.
        """
        from .io import load_routes

        return load_routes(cls, path, device, validate=validate)

    @classmethod
    def _trusted(
        cls,
        indices: torch.Tensor,
        mask: torch.Tensor,
        layers: tuple[LayerInfo, ...],
        version: torch.Tensor | None = None,
    ) -> Routes:
        """Build without re-validating values (for slices and joins of already valid Routes)."""
        obj = cls.__new__(cls)
        obj.indices, obj.mask, obj.layers, obj.version = indices, mask, layers, version
        return obj


def check_structure(indices: torch.Tensor, mask: torch.Tensor, layers: Sequence[LayerInfo]) -> tuple[LayerInfo, ...]:
    """Shapes, dtypes, devices and layers of a would-be `Routes` (no per-id check); raise naming both sides."""
    layers = tuple(layers)
    if not all(isinstance(layer, LayerInfo) for layer in layers):
        raise ValueError(f"layers must be LayerInfo objects, got {[type(x).__name__ for x in layers]}")
    if not isinstance(indices, torch.Tensor) or indices.dim() != 4:
        got = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"indices must be a [B, T, L, K] tensor, got {got}")
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"indices must have an integer dtype, got {indices.dtype}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
    B, T, L, K = indices.shape
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match indices [B, T] = {(B, T)}")
    if L != len(layers):
        raise ValueError(f"indices have L={L} layers but {len(layers)} LayerInfo were given")
    if mask.device != indices.device:
        raise ValueError(f"mask is on {mask.device} but indices on {indices.device}")
    return check_layers(layers, K, f"indices have K={K}")


def _pad_t(x: torch.Tensor, T: int) -> torch.Tensor:
    if x.shape[1] == T:
        return x
    pad = x.new_zeros((x.shape[0], T - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)

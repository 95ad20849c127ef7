"""How many routed experts differ between two `Routes` over the same tokens (torch only).

Shape legend: B sequences, T positions, L MoE layers, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..routes import Routes, layer_diff


@dataclass(frozen=True)
class ExpertChange:
    """Per (token, layer) counts of routed experts that differ between two `Routes`.

    `changed` is [B, T, L] with K − |A ∩ B| (0..K) for each token and layer; `valid` is bool [B, T], True where both
    `Routes` recorded the position. Aggregates count valid positions only.

    Example:
        >>> change = expert_change(before, after)  # doctest: +SKIP
        >>> change.fraction, change.set_changed, change.token_changed  # doctest: +SKIP
        (0.021, 0.04, 0.11)
    """

    changed: torch.Tensor
    valid: torch.Tensor
    layers: tuple[str, ...]
    top_k: int
    label: str = "before vs after"

    @property
    def num_tokens(self) -> int:
        """Positions recorded in both `Routes`."""
        return int(self.valid.sum())

    @property
    def fraction(self) -> float:
        """Share of routed (token, layer, slot) choices that differ: 1 − |A∩B|/K averaged over tokens and layers."""
        return float(self._valid_changed().sum(dtype=torch.float64) / (self.num_tokens * len(self.layers) * self.top_k))

    @property
    def set_changed(self) -> float:
        """Share of (token, layer) pairs whose expert set changed at all."""
        return float((self._valid_changed() > 0).sum(dtype=torch.float64) / (self.num_tokens * len(self.layers)))

    @property
    def token_changed(self) -> float:
        """Share of tokens whose expert set changed in at least one layer."""
        return float((self._valid_changed() > 0).any(-1).sum(dtype=torch.float64) / self.num_tokens)

    def layer_fractions(self) -> torch.Tensor:
        """[L] share of routed choices that differ, per layer (float64)."""
        return self._valid_changed().sum(0, dtype=torch.float64) / (self.num_tokens * self.top_k)

    def layer_set_changed(self) -> torch.Tensor:
        """[L] share of tokens whose expert set changed, per layer (float64)."""
        return (self._valid_changed() > 0).sum(0, dtype=torch.float64) / self.num_tokens

    @property
    def per_layer(self):  # noqa: ANN201 - pandas is imported lazily
        """pandas Series of `fraction` per layer, indexed by layer name."""
        from .tables import per_layer_series

        return per_layer_series(self)

    def to_frame(self, buckets: int = 4):  # noqa: ANN201
        """Tidy pandas DataFrame: layer, position bucket, metric, value, tokens (see `tables.change_frame`)."""
        from .tables import change_frame

        return change_frame(self, buckets=buckets)

    @cached_property
    def _flat(self) -> torch.Tensor:
        return self.changed[self.valid]  # [N, L]

    def _valid_changed(self) -> torch.Tensor:
        return self._flat

    def __repr__(self) -> str:
        return (
            f"ExpertChange({self.label}: fraction={self.fraction:.4f}, set_changed={self.set_changed:.4f}, "
            f"token_changed={self.token_changed:.4f}, tokens={self.num_tokens}, L={len(self.layers)}, K={self.top_k})"
        )


def expert_change(before: Routes, after: Routes, *, label: str = "before vs after") -> ExpertChange:
    """Compare the experts chosen in two `Routes` over the same tokens (K order ignored; masked positions skipped).

    Example:
        >>> change = expert_change(routes_old_policy, routes_new_policy)  # doctest: +SKIP
        >>> print(f"{change.fraction:.1%} of routed experts changed")  # doctest: +SKIP
    """
    for name, r in (("before", before), ("after", after)):
        if not isinstance(r, Routes):
            raise ValueError(f"expert_change needs two Routes, got {type(r).__name__} for {name!r}")
    if before.shape != after.shape:
        raise ValueError(
            f"Routes over different tokens or layers: before has [B, T, L, K] = {list(before.shape)}, "
            f"after has {list(after.shape)}"
        )
    if before.layers != after.layers:  # (names, E and K: ids of E=8 and E=300 experts are not the same experts)
        raise ValueError(f"Routes over different layers: {layer_diff(before.layers, after.layers)}")
    if before.device != after.device:
        raise ValueError(f"before is on {before.device}, after on {after.device}: move one with .to()")
    if not before.layers:
        raise ValueError("the Routes hold no layers (L = 0): nothing to compare")
    valid = before.mask & after.mask
    if not bool(valid.any()):
        raise ValueError("no position is recorded in both Routes: nothing to compare")
    return ExpertChange(
        _changed_slots(before.indices, after.indices), valid, tuple(before.layer_names), before.top_k, label
    )


def _changed_slots(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """[B, T, L] number of experts of `a` not in `b`, K − |A∩B| (experts are distinct within a set)."""
    B, T, L, K = a.shape
    fa, fb = a.reshape(-1, K), b.reshape(-1, K)
    out = torch.empty(fa.shape[0], dtype=torch.uint8 if K < 256 else torch.int16, device=a.device)
    rows = max(1, chunk // (K * K))
    for s in range(0, fa.shape[0], rows):
        x, y = fa[s : s + rows], fb[s : s + rows]
        common = (x.unsqueeze(-1) == y.unsqueeze(-2)).sum((-1, -2))
        out[s : s + rows] = K - common
    return out.reshape(B, T, L)

"""The layers of `Routes`: `LayerInfo` (one router's name, E and K), the id dtype for E, and layer-list checks.

Shape legend: L layers, E experts, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerInfo:
    """One router: its qualified module name, its number of experts E and its top-k K.

    Example:
        >>> LayerInfo("model.layers.0.mlp.gate", num_experts=8, top_k=2)
        LayerInfo(name='model.layers.0.mlp.gate', num_experts=8, top_k=2)
    """

    name: str
    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        counts = (self.num_experts, self.top_k)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts) or not isinstance(self.name, str):
            raise ValueError(
                f"layer {self.name!r}: the name must be a str and num_experts and top_k ints, got "
                f"{self.num_experts!r}, {self.top_k!r}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"layer {self.name!r}: top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")


def index_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids 0..num_experts-1 (uint8 up to 256 experts, int16 above).

    Example:
        >>> index_dtype(128), index_dtype(257)
        (torch.uint8, torch.int16)
    """
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    if num_experts <= 2**31:
        return torch.int32
    raise ValueError(f"num_experts={num_experts} does not fit int32 expert ids")


def check_layers(layers: Sequence[LayerInfo], K: int, what: str) -> tuple[LayerInfo, ...]:
    """`layers` as a tuple of `LayerInfo`s with unique names, each of top_k `K` (`what` says whose K it is);
    raise naming both sides.

    Example:
        >>> check_layers([LayerInfo("a", 8, 2)], 2, "indices have K=2")
        (LayerInfo(name='a', num_experts=8, top_k=2),)
    """
    layers = tuple(layers)
    if not all(isinstance(layer, LayerInfo) for layer in layers):
        raise ValueError(f"layers must be LayerInfo objects, got {[type(x).__name__ for x in layers]}")
    for layer in layers:
        if layer.top_k != K:
            raise ValueError(f"layer {layer.name!r} has top_k={layer.top_k} but {what}")
    names = [layer.name for layer in layers]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ValueError(f"layer names must be unique, but {twice!r} appears {names.count(twice)} times")
    return layers


def layer_diff(a: Sequence[LayerInfo], b: Sequence[LayerInfo]) -> str:
    """Describe where two layer lists differ, naming both sides."""
    if len(a) != len(b):
        return f"{len(a)} layers vs {len(b)} layers"
    for x, y in zip(a, b, strict=True):
        if x != y:
            return f"{x} vs {y}"
    return "no difference"

"""`Routes` that know where they sit in a larger layout (a packed row's boundaries, a context-parallel rank's part),
so that a replay can check the forward they are given to against it.

Moving them (`.to`) and selecting sequences keep the place; anything that builds other positions (padding, joining)
and a file give a plain `Routes` (a pickle, e.g. `all_gather_object`, keeps it).

Shape legend: B sequences, T positions, L layers, K experts per token.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from .core import IndexLike, Routes


class PlacedRoutes(Routes):
    """A `Routes` with a place: the subclass names its fields (`PLACE`), all given when it is made.

    Example:
        >>> part = to_cp(routes, cp_size=2, cp_rank=1)  # doctest: +SKIP
        >>> part.place()  # doctest: +SKIP
        {'cp_size': 2, 'cp_rank': 1, 'cu_seqlens_padded': None}
    """

    PLACE: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, indices: torch.Tensor, mask: torch.Tensor, layers: Any, version: torch.Tensor | None = None, **place: Any
    ) -> None:
        super().__init__(indices, mask, layers, version)
        self._set_place(place)

    @classmethod
    def placed(cls, routes: Routes, **place: Any) -> PlacedRoutes:
        """`routes` (already laid out at that place) with its place, without re-validating the ids."""
        obj = object.__new__(cls)
        obj.indices, obj.mask, obj.layers, obj.version = routes.indices, routes.mask, routes.layers, routes.version
        obj._set_place(place)
        return obj

    def _set_place(self, place: dict[str, Any]) -> None:
        if set(place) != set(self.PLACE):
            raise TypeError(f"{type(self).__name__} needs its place {list(self.PLACE)}, got {sorted(place)}")
        for key, value in place.items():
            setattr(self, key, value)

    def place(self) -> dict[str, Any]:
        """The place's fields by name."""
        return {key: getattr(self, key) for key in self.PLACE}

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu", *, validate: bool = True) -> Routes:
        """A file holds no place: a plain `Routes`."""
        return Routes.load(path, device, validate=validate)

    def to(self, device: torch.device | str) -> PlacedRoutes:
        return type(self).placed(super().to(device), **self.place())

    def __getitem__(self, idx: IndexLike) -> PlacedRoutes:
        return type(self).placed(super().__getitem__(idx), **self.place())

    def where(self) -> str:
        """The place in words, for messages."""
        return ", ".join(f"{k}={v}" for k, v in self.place().items())

    def __repr__(self) -> str:
        return f"{type(self).__name__}{super().__repr__()[len('Routes') : -1]}, {self.where()})"

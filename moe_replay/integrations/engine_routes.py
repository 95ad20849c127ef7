"""`EngineRoutes`: the routes an engine importer returns, with each row's token ids as the engine reported them, so
that a consumer (TRL's `rollout_func` hand-over) can check that every row of routes sits on its own row of tokens:
two rows of equal length swapped pass every length check, never this one.

Shape legend: B rows, T positions, L layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..routes import IndexLike, Routes
from ..routes.index import batch_index

Tokens = tuple[int, ...] | None  # a row's prompt + completion token ids, or None where the engine gave only counts


class EngineRoutes(Routes):
    """A `Routes` [B, T, L, K] whose row i was imported for the tokens `tokens[i]` (prompt + completion ids, None
    where the engine reported only counts). Moving it (`.to`) and selecting rows keep the rows' tokens; anything that
    builds other positions (padding, joining) and a file give a plain `Routes`.

    Example:
        >>> routes = routes_from_vllm(outputs, model)  # doctest: +SKIP
        >>> routes.tokens[0][:4]  # doctest: +SKIP
        (151644, 872, 198, 3838)
    """

    tokens: tuple[Tokens, ...]

    @classmethod
    def of(cls, routes: Routes, tokens: Sequence[Tokens]) -> EngineRoutes:
        """`routes` with one entry of `tokens` per row, without re-validating the ids."""
        if len(tokens) != routes.batch_size:
            raise ValueError(f"{len(tokens)} rows of tokens for routes of B={routes.batch_size}")
        obj = object.__new__(cls)
        obj.indices, obj.mask, obj.layers, obj.version = routes.indices, routes.mask, routes.layers, routes.version
        obj.tokens = tuple(None if t is None else tuple(t) for t in tokens)
        return obj

    def to(self, device: torch.device | str) -> EngineRoutes:
        return EngineRoutes.of(super().to(device), self.tokens)

    def __getitem__(self, idx: IndexLike) -> EngineRoutes:
        rows = torch.arange(self.batch_size)[batch_index(idx, self.batch_size, torch.device("cpu"))]
        return EngineRoutes.of(super().__getitem__(idx), [self.tokens[i] for i in rows.reshape(-1).tolist()])

    def check_rows(self, prompt_ids: Sequence[Any], completion_ids: Sequence[Any], where: str) -> None:
        """Raise ValueError unless each row's tokens begin with that row's `prompt_ids[i]` + `completion_ids[i]` (a
        consumer may cut a completion after its end token; rows without token ids are not checked); `where` names
        the routes' source in the message.

        Example:
            >>> routes.check_rows(out["prompt_ids"], out["completion_ids"], "the routes")  # doctest: +SKIP
        """
        for i, (own, prompt, completion) in enumerate(zip(self.tokens, prompt_ids, completion_ids, strict=True)):
            if own is None:
                continue
            given = tuple(_as_list(prompt)) + tuple(_as_list(completion))
            if own[: len(given)] != given:
                at = next(
                    (t for t, (a, b) in enumerate(zip(own, given, strict=False)) if a != b), min(len(own), len(given))
                )
                raise ValueError(
                    f"{where}: row {i} was imported for other tokens than its prompt_ids + completion_ids (they first "
                    f"differ at position {at}, of {len(own)} and {len(given)} tokens): rows reordered, or routes of "
                    "another request; keep the engine's outputs in the order of the rows"
                )


def _as_list(ids: Any) -> list:
    """Token ids (a list, or a tensor or array of them) as a list of Python ints."""
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)

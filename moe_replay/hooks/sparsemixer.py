"""PhiMoE's sparsemixer: the two experts are picked by masked `max(dim=-1)` calls (or Gumbel samples), not a top-k.

In eval mode the picks are the indices of two `max(..., keepdim=True)` calls: the top score, then the top score with
the first pick masked out; each value is also the threshold that masks far-away experts. In training mode each pick
is a Gumbel sample (`max(dim=-1)` without keepdim) between a threshold `max` and a Heun-midpoint `max`.

Replay forces the picks to the recorded experts and the thresholds to the recorded experts' scores (so the mask is
taken relative to the expert that is used, as it is live); the midpoint calls run live. The family's own softmax and
its custom backward (PhimoeMultiplier) then run on live scores.
"""

from __future__ import annotations

from typing import Any

import torch

ROUTER_CLASSES = frozenset({"PhimoeTopKRouter"})
MAX_FUNCS = {torch.max, torch.Tensor.max}


def max_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any, bool]:
    """(input, dim, keepdim) of a `max` call; dim is None for the full reduction."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    return x, dim, keepdim


def slot_of(counts: list[int], keepdim: bool, training: bool) -> tuple[int | None, bool]:
    """Which pick (0 or 1) a per-token `max(dim=-1)` call decides, and whether its indices are the pick itself.

    `counts` = [keepdim calls so far, other calls so far] in this router call; it is advanced here.
    """
    j = counts[0] if keepdim else counts[1]
    counts[0 if keepdim else 1] += 1
    if not training:
        return (j, True) if keepdim else (None, False)
    if keepdim:  # threshold (even) / Heun midpoint (odd, live)
        return (j // 2, False) if j % 2 == 0 else (None, False)
    return j, True  # Gumbel sample


def forced_max(func: Any, args: tuple, kwargs: dict, indices: torch.Tensor, mask: torch.Tensor, all_recorded: bool):
    """`max(x, dim=-1[, keepdim])` with the recorded expert `indices` [N] (live where `mask` is False)."""
    x, _, keepdim = max_args(args, kwargs)
    idx = indices.to(x.device).reshape(*x.shape[:-1], 1)
    if not all_recorded:
        live = func(*args, **kwargs)[1]
        live = live if keepdim else live.unsqueeze(-1)
        idx = torch.where(mask.to(x.device).reshape(*x.shape[:-1], 1), idx, live)
    values = x.gather(-1, idx)
    if not keepdim:
        values, idx = values.squeeze(-1), idx.squeeze(-1)
    return torch.return_types.max((values, idx))

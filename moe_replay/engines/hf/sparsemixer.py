"""PhiMoE's sparsemixer: the two experts are picked by masked `max(dim=-1)` calls (or Gumbel samples), not a top-k.

In eval mode the picks are the indices of two `max(..., keepdim=True)` calls (the top score, then the top score with
the first pick masked out), each value also the threshold that masks far-away experts. In training each pick is a
Gumbel sample (`max(dim=-1)` without keepdim) between a threshold `max` and a Heun-midpoint `max` (run live).

Replay forces the picks to the recorded experts. In eval mode a threshold is its pick, so it is forced to the
recorded expert's score too (the mask is taken relative to the expert that is used, as it is live). In training the
threshold is the live top score, as when the pick was sampled, except where it would mask the recorded expert out
(its score more than 2·jitter_eps below, relative to the larger magnitude: a policy that moved since): there it is
that score, so that it stays selectable. The softmax and custom backward (PhimoeMultiplier) run on live scores."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import UnsupportedModelError
from .selectors import Selector, over_each_token
from .stream import hold

ROUTER_CLASSES = frozenset({"PhimoeTopKRouter"})
MAX_FUNCS = frozenset({torch.max, torch.Tensor.max})


def max_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any, bool]:
    """(input, dim, keepdim) of a `max` call; dim is None for the full reduction."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return args[0], dim, bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))


def slot_of(counts: list[int], keepdim: bool, training: bool) -> tuple[int | None, bool]:
    """Which pick (0 or 1) a per-token `max(dim=-1)` call decides, and whether its indices are the pick itself;
    advances `counts` = [keepdim calls so far, other calls so far] in this router call."""
    j = counts[0] if keepdim else counts[1]
    counts[0 if keepdim else 1] += 1
    if not training:
        return (j, True) if keepdim else (None, False)
    if keepdim:  # threshold (even) / Heun midpoint (odd, live)
        return (j // 2, False) if j % 2 == 0 else (None, False)
    return j, True  # Gumbel sample


def kept_threshold(
    func: Any, args: tuple, kwargs: dict, indices: torch.Tensor, mask: torch.Tensor, eps: float
) -> torch.return_types.max:
    """A training-mode threshold `max(x, dim=-1, keepdim=True)`: the live top score, or the recorded expert's
    (`indices` [N]) where the live one would mask it out; live where `mask` is False (see the module docstring).

    Example:
        >>> x = torch.tensor([[1.0, 0.5, 0.99]])
        >>> kept_threshold(torch.max, (x, -1, True), {}, torch.tensor([1]), torch.tensor([True]), 0.01).values
        tensor([[0.5000]])
    """
    x = args[0]
    values, live = func(*args, **kwargs)
    recorded = x.gather(-1, indices.to(x.device).reshape(*x.shape[:-1], 1))
    masked_out = ((values - recorded) / recorded.abs().clamp(min=values)) > (2 * eps)
    masked_out &= mask.to(x.device).reshape(*x.shape[:-1], 1)
    return torch.return_types.max((torch.where(masked_out, recorded, values), live))


def forced_max(func: Any, args: tuple, kwargs: dict, indices: torch.Tensor, mask: torch.Tensor, all_recorded: bool):
    """`max(x, dim=-1[, keepdim])` with the recorded expert `indices` [N] (live where `mask` is False)."""
    x, _, keepdim = max_args(args, kwargs)
    idx = indices.to(x.device).reshape(*x.shape[:-1], 1)
    if not all_recorded:
        live = func(*args, **kwargs)[1].reshape(idx.shape)  # (keepdim or not)
        idx = torch.where(mask.to(x.device).reshape(*x.shape[:-1], 1), idx, live)
    values = x.gather(-1, idx)
    if not keepdim:
        values, idx = values.squeeze(-1), idx.squeeze(-1)
    return torch.return_types.max((values, idx))


class SparsemixerPicks(Selector):
    """PhiMoE's two picks by per-token `max(dim=-1)` calls (see the module docstring)."""

    funcs = MAX_FUNCS

    def __init__(self, call: Any) -> None:
        super().__init__(call)
        self.counts = [0, 0]  # keepdim calls so far, other calls so far
        self.picks: dict[int, tuple[torch.Tensor, int | None]] = {}  # pick slot -> `hold` of its indices
        self.replaced = 0

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        x, dim, keepdim = max_args(args, kwargs)
        call, plan, training = self.call, self.call.plan, self.call.site.router.training
        if call.step is None or dim not in (-1, x.dim() - 1) or not over_each_token(x, call.step.tokens):
            return func(*args, **kwargs)
        slot, is_pick = slot_of(self.counts, keepdim, training)
        if slot is None or (plan is not None and (slot >= plan.top_k or x.shape[-1] != plan.num_experts)):
            return func(*args, **kwargs)
        if plan is not None and training and not is_pick:  # a training-mode threshold: live, unless it masks the pick
            eps = float(getattr(call.site.router, "router_jitter_noise", 0.0) or 0.0)
            out = kept_threshold(func, args, kwargs, plan.indices[:, slot], plan.mask, eps)
        elif plan is not None:
            out = forced_max(func, args, kwargs, plan.indices[:, slot], plan.mask, plan.all_recorded)
            self.replaced += is_pick
        else:
            out = func(*args, **kwargs)
        if call.record and is_pick:
            self.picks[slot] = hold(out[1])  # (as returned: an edit before they are copied is caught)
        return out

    def picked(self) -> tuple[torch.Tensor, int | None] | None:
        if not self.picks:
            return None
        n, picks = self.call.step.tokens, [self.picks[j] for j in sorted(self.picks)]
        for j, (idx, version) in enumerate(picks):
            if version is not None and idx._version != version:
                raise UnsupportedModelError(
                    f"router {self.call.layer!r}'s pick {j} was changed in place after its max returned it: the "
                    "routes would not be the experts the model used"
                )
        return torch.cat([idx.reshape(n, 1) for idx, _ in picks], -1), None  # (a copy)

    def applied(self) -> bool:
        return self.call.plan is not None and self.replaced >= self.call.plan.top_k

    def describe(self) -> str:
        k = self.call.plan.top_k if self.call.plan is not None else None
        return f"{self.replaced} of its k={k} per-token max picks were replaced"

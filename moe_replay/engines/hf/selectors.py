"""The ways a router picks its experts, one *selector* each, chosen per router when the routers are found.

Inside a router call the hub sees every torch function of the router (and, until it learns better, of its MoE block)
and hands the ones a selector intercepts to it. A selector records what the call selected and, under replay, returns
the recorded experts instead, with values gathered from its own (live) input, so the family's weight rule runs on the
live router scores and the router keeps its gradient. A new routing rule is one new selector and one line in
`selectors_for`.

- `TopK`: the top-k over the E scores of each token (most families);
- `GroupTopK`: a group-limited top-k before it (DeepSeek-style `n_group` / `topk_group`), steered to keep the groups
  of the recorded experts, or their scores would be masked to zero;
- `SparsemixerPicks` (sparsemixer.py): PhiMoE's picks by masked `max` calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...errors import ReplayError
from .stream import hold

if TYPE_CHECKING:
    from .call import Plan, RouterCall

TOPK_FUNCS = frozenset({torch.topk, torch.Tensor.topk})


class Selector:
    """One way of picking experts, for one router call. Subclasses set `funcs` and override what they need."""

    funcs: frozenset = frozenset()

    def __init__(self, call: RouterCall) -> None:
        self.call = call

    def claims(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether this selector handles this intercepted call (the first selector that claims it runs it)."""
        return True

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run the call: live, or forced to the plan's experts."""
        return func(*args, **kwargs)

    @property
    def active(self) -> bool:
        """Whether the call selected experts through this selector."""
        return False

    def picked(self) -> tuple[torch.Tensor, torch.Tensor, int | None, bool] | None:
        """What the call selected, or None: (the indices, with last dim K; what a recorder holds of them and their
        version when they were selected, as `stream.hold` gave them; whether the indices are the router's own top-k
        output)."""
        return None

    def applied(self) -> bool:
        """Whether the replay plan decided this call's experts."""
        return False

    def describe(self) -> str:
        """What the selector saw, for error messages."""
        return ""


def topk_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, int, bool]:
    """(input, k, whether the top-k runs over the last dim) of a `topk` call."""
    x: torch.Tensor = args[0]
    k = int(args[1] if len(args) > 1 else kwargs["k"])
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return x, k, dim in (-1, x.dim() - 1)


class TopK(Selector):
    """The top-k over the E router scores of each token: input [..., E] with N·E elements, N = tokens of the forward."""

    funcs = TOPK_FUNCS

    def __init__(self, call: RouterCall) -> None:
        self.call = call  # (Selector.__init__, inlined: one call fewer per router call)
        # (last dim, k, numel, indices, `hold(indices)` as they were returned if the call is recorded)
        self.seen: list[tuple[int, int, int, torch.Tensor, tuple[torch.Tensor, int | None] | None]] = []
        self.replaced = 0

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        x, k, last = topk_args(args, kwargs)
        call, plan = self.call, self.call.plan
        if plan is not None and last and replaces(plan, call.step.tokens, x, k):
            out = forced_topk(func, args, kwargs, x, plan, observe=plan.observe and self._observes())
            self.replaced += 1
        else:
            out = func(*args, **kwargs)
        if last and (call.record or plan is not None):
            idx = out[1]  # (held now: an edit after the top-k returned, even inside the router, is caught)
            self.seen.append((x.shape[-1], k, x.numel(), idx, hold(idx) if call.record else None))
        return out

    def _observes(self) -> bool:
        """Whether to report the live picks (asked only where the plan has `on_live`): a forward call (not its
        recompute) that no other selector steered."""
        call = self.call
        return not call.recompute and self.replaced == 0 and not any(getattr(s, "steered", 0) for s in call.selectors)

    @property
    def active(self) -> bool:
        return bool(self.seen)

    def picked(self) -> tuple[torch.Tensor, torch.Tensor, int | None, bool] | None:
        E, n = self.call.num_experts, self.call.step.tokens
        found = [s for s in self.seen if s[0] == E and s[2] == E * n]
        if not found or found[-1][4] is None:
            return None
        held, version = found[-1][4]
        return found[-1][3], held, version, True

    def applied(self) -> bool:
        return self.replaced >= 1

    def describe(self) -> str:
        return topk_calls([(s[0], s[1]) for s in self.seen])


class GroupTopK(Selector):
    """Group-limited routing under replay: the top-k over G expert groups (G divides E) keeps the groups that hold
    the recorded experts, and fills the rest live."""

    funcs = TOPK_FUNCS

    def __init__(self, call: RouterCall) -> None:
        super().__init__(call)
        self.steered = 0

    def claims(self, func: Any, args: tuple, kwargs: dict) -> bool:
        plan = self.call.plan
        if plan is None:
            return False
        x, k, last = topk_args(args, kwargs)
        G = x.shape[-1]
        return (
            last
            and G < plan.num_experts
            and plan.num_experts % G == 0
            and x.numel() == self.call.step.tokens * G
            and k <= G
        )

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        x, k, _ = topk_args(args, kwargs)
        plan = self.call.plan
        assert plan is not None
        G = x.shape[-1]
        flat = x.reshape(-1, G)
        if plan.groups_used(G) > k:  # checked once per layer, not per call
            raise ReplayError(
                f"router {self.call.layer!r} keeps topk_group={k} of {G} expert groups, but the routes use "
                f"{plan.groups_used(G)} groups for one token"
            )
        indices = plan.indices
        if indices.device != x.device:
            indices = indices.to(x.device)
        steered = flat.scatter(-1, indices // (plan.num_experts // G), float("inf"))  # the recorded experts' groups
        if not plan.all_recorded:
            steered = torch.where(plan.mask.to(x.device).reshape(-1, 1), steered, flat)
        idx = torch.topk(steered, k, dim=-1).indices
        idx = idx.reshape(*x.shape[:-1], k)
        self.steered += 1
        return torch.return_types.topk((x.gather(-1, idx), idx))

    @property
    def active(self) -> bool:
        return self.steered > 0


def dispatch(call: RouterCall, func: Any, args: tuple, kwargs: dict, in_router: Callable[[], bool]) -> Any:
    """Run torch function `func` of router call `call`: by the first of its selectors that claims it, else as is
    (`in_router()`: whether the router module itself is running, else the call ran in its MoE block)."""
    for selector in call.selectors:
        if func in selector.funcs and selector.claims(func, args, kwargs):
            call.outside_router |= not in_router()
            return selector.run(func, args, kwargs)
    return func(*args, **kwargs)


def topk_calls(seen: list[tuple[int, int]]) -> str:
    """What a router's top-k calls over the last dim were, (last dim, k) each, for a replay error."""
    return f"the router's top-k calls were (E, k) = {seen}"


def replaces(plan: Plan, tokens: int, x: torch.Tensor, k: int) -> bool:
    """Whether a top-k (over the last dim) of `x` is the selection `plan` replaces: k of the plan's E scores for each
    of the forward's `tokens` tokens."""
    E = plan.num_experts
    return x.shape[-1] == E and k == plan.top_k and x.numel() == tokens * E


def forced_topk(func: Any, args: tuple, kwargs: dict, x: torch.Tensor, plan: Plan, observe: bool = False) -> Any:
    """`topk(x)` that returns the plan's experts with values gathered from `x` (live where the plan's mask is False);
    with `observe`, hands the live and the forced picks to `plan.on_live`."""
    idx = plan.indices  # [N, K]
    if idx.device != x.device:
        idx = idx.to(x.device)
    if x.dim() != 2:
        idx = idx.reshape(*x.shape[:-1], plan.top_k)
    live = None
    if not plan.all_recorded:
        live = func(*args, **kwargs)[1]
        idx = torch.where(plan.mask.to(x.device).reshape(*x.shape[:-1], 1), idx, live)
    if observe:
        if live is None:  # only to observe: no grad, so a checkpoint's recompute saves the same tensors as the forward
            with torch.no_grad():
                live = func(*args, **kwargs)[1]
        plan.on_live(live.reshape(-1, plan.top_k), idx.reshape(-1, plan.top_k))
    return torch.return_types.topk((x.gather(-1, idx), idx))


def selectors_for(router: nn.Module) -> tuple[type[Selector], ...]:
    """The selectors of a router, in the order they are offered each intercepted call.

    Example:
        >>> selectors_for(model.model.layers[0].mlp.gate)  # doctest: +SKIP
        (GroupTopK, TopK)
    """
    from .sparsemixer import ROUTER_CLASSES, SparsemixerPicks

    if type(router).__name__ in ROUTER_CLASSES:
        return (SparsemixerPicks,)
    return (GroupTopK, TopK)

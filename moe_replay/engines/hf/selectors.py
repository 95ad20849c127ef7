"""The ways a router picks its experts, one *selector* each, chosen per router when the routers are found.

Inside a router call the hub sees every torch function of the router (and, on the general path, of its MoE block) and
hands the ones a selector intercepts to it. A selector records what the call selected and, under replay, returns
the recorded experts instead, with values gathered from its own (live) input, so the family's weight rule runs on the
live router scores and the router keeps its gradient. A new routing rule is one new selector and one line in
rules.py (`TopK`, `GroupTopK`, sparsemixer.py's `SparsemixerPicks`)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ...errors import ReplayError
from .discover import RouterSite
from .plan import Plan
from .steps import Step
from .stream import hold


class RouterCall(Protocol):
    """What a selector reads of its router call (call.RouterCall)."""

    site: RouterSite
    layer: str
    step: Step | None  # None: a recompute that routes live
    plan: Plan | None
    record: bool
    recompute: bool
    num_experts: int | None
    selectors: list[Selector]


TOPK_FUNCS = frozenset({torch.topk, torch.Tensor.topk})


class Selector:
    """One way of picking experts, for one router call. Its contract (`rules.check_rules`): `funcs`, the torch functions
    it may claim (`claims` is asked only for those); `catch_all`: it claims every call of them, so is offered last."""

    funcs: frozenset = frozenset()
    catch_all: bool = False

    def __init__(self, call: RouterCall) -> None:
        self.call = call

    def claims(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether this selector handles this intercepted call (the first selector that claims it runs it)."""
        return True

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run the call: live, or forced to the plan's experts."""
        return func(*args, **kwargs)

    def picked(self) -> tuple[torch.Tensor, int | None] | None:
        """What the call selected (its indices, last dim K, as `stream.hold` gave them), or None."""
        return None

    def applied(self) -> bool:
        """Whether the replay plan decided this call's experts."""
        return False

    def describe(self) -> str:
        """What the selector saw, for error messages."""
        return ""


def over_each_token(x: torch.Tensor, tokens: int) -> bool:
    """Whether `x` [..., S] holds one row of S scores per token of a forward of `tokens` tokens: the input of every
    selection a selector acts on (a token's E expert scores, its G group scores).

    Example:
        >>> over_each_token(torch.zeros(2, 3, 8), 6)
        True
    """
    shape = x.shape  # (read once: each read of a tensor's shape makes a new torch.Size)
    return shape.numel() == tokens * shape[-1]


def replaces(plan: Plan, tokens: int, x: torch.Tensor, k: int) -> bool:
    """Whether a top-k (over the last dim) of `x` is the selection `plan` replaces: k = K of the plan's E scores of
    each of the forward's `tokens` tokens (the one rule of which top-k a replay forces).

    Example:
        >>> replaces(plan, 6, torch.zeros(2, 3, plan.num_experts), plan.top_k)  # doctest: +SKIP
        True
    """
    shape, E = x.shape, plan.num_experts
    return k == plan.top_k and shape[-1] == E and shape.numel() == tokens * E


def topk_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, int, bool]:
    """(input, k, whether the top-k runs over the last dim) of a `topk` call."""
    x: torch.Tensor = args[0]
    k, dim = args[1] if len(args) > 1 else kwargs["k"], args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return x, k if type(k) is int else int(k), dim == -1 or dim == x.dim() - 1


class TopK(Selector):
    """The top-k over the E router scores of each token (`replaces`): every other top-k it runs as it is."""

    funcs = TOPK_FUNCS
    catch_all = True

    def __init__(self, call: RouterCall) -> None:
        super().__init__(call)
        # (last dim, k, over each token's scores, `hold(indices)` as returned if the call is recorded)
        self.seen: list[tuple[int, int, bool, tuple[torch.Tensor, int | None] | None]] = []
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
            per_token = call.step is not None and over_each_token(x, call.step.tokens)
            self.seen.append((x.shape[-1], k, per_token, hold(idx) if call.record else None))
        return out

    def _observes(self) -> bool:
        """Whether to report the live picks: a forward call (not its recompute) that no other selector steered."""
        call = self.call
        return not call.recompute and self.replaced == 0 and not any(getattr(s, "steered", 0) for s in call.selectors)

    def picked(self) -> tuple[torch.Tensor, int | None] | None:
        return next((s[3] for s in reversed(self.seen) if s[0] == self.call.num_experts and s[2]), None)

    def applied(self) -> bool:
        return self.replaced >= 1

    def describe(self) -> str:
        return f"the router's top-k calls were (E, k) = {[(s[0], s[1]) for s in self.seen]}"


class GroupTopK(Selector):
    """Group-limited routing (DeepSeek-style `n_group` / `topk_group`) under replay: the top-k over G expert groups (G
    divides E) keeps the recorded experts' groups (else their scores are masked to zero), and fills the rest live."""

    funcs = TOPK_FUNCS

    def __init__(self, call: RouterCall) -> None:
        super().__init__(call)
        self.steered = 0

    def claims(self, func: Any, args: tuple, kwargs: dict) -> bool:
        if (plan := self.call.plan) is None:
            return False
        x, k, last = topk_args(args, kwargs)
        G, tokens = x.shape[-1], self.call.step.tokens
        return last and G < plan.num_experts and plan.num_experts % G == 0 and k <= G and over_each_token(x, tokens)

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        x, k, _ = topk_args(args, kwargs)
        plan = self.call.plan
        assert plan is not None
        G, flat = x.shape[-1], x.reshape(-1, x.shape[-1])
        if plan.groups_used(G) > k:  # checked once per layer, not per call
            raise ReplayError(
                f"router {self.call.layer!r} keeps topk_group={k} of {G} expert groups, but the routes use "
                f"{plan.groups_used(G)} groups for one token"
            )
        indices = plan.indices if x.device == plan.device else plan.indices.to(x.device)
        steered = flat.scatter(-1, indices // (plan.num_experts // G), float("inf"))  # the recorded experts' groups
        if not plan.all_recorded:
            steered = torch.where(plan.mask.to(x.device).reshape(-1, 1), steered, flat)
        idx = torch.topk(steered, k, dim=-1).indices.reshape(*x.shape[:-1], k)
        self.steered += 1
        return torch.return_types.topk((x.gather(-1, idx), idx))


def dispatch(call: RouterCall, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run torch function `func` of router call `call`: by the first of its selectors that claims it, else as is."""
    for selector in call.selectors:
        if func in selector.funcs and selector.claims(func, args, kwargs):
            return selector.run(func, args, kwargs)
    return func(*args, **kwargs)


def forced_topk(func: Any, args: tuple, kwargs: dict, x: torch.Tensor, plan: Plan, observe: bool = False) -> Any:
    """`topk(x)` that returns the plan's experts with values gathered from `x` (live where the plan's mask is False);
    with `observe`, hands the live and the forced picks to `plan.on_live`."""
    idx = plan.indices if x.device == plan.device else plan.indices.to(x.device)  # [N, K]
    if x.ndim != 2:
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

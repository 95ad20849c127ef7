"""One router call: which layer and positions it is, which routes it must use, what its selectors saw, and how the
hub opens and closes it (`begin_call`, `end_call`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from ...errors import ReplayError
from ..autograd import in_backward
from .discover import RouterSite
from .plan import Plan
from .redirect import caller_code, redirectable
from .selectors import TOPK_FUNCS, Selector, dispatch, over_each_token, topk_args
from .steps import Step


@dataclass(slots=True)
class RouterCall:
    """One run of one router inside a forward (or its recompute in the backward)."""

    index: int  # the router's position among the model's routers
    site: RouterSite
    layer: str  # the router's name; `name#n` for its n-th extra call in one forward (looped layers)
    step: Step | None  # None: a recompute whose forward routed live
    plan: Plan | None
    record: bool
    recompute: bool = False  # a checkpoint recompute in the backward
    router_runs: int = 0  # forwards of the router module started in this call (its MoE block may run it twice)
    selectors: list[Selector] = field(default_factory=list)
    num_experts: int | None = None  # E, read from the router's logits
    router_out: Any = None
    outside_router: bool = False  # an intercepted call ran in the MoE block, outside the router
    intercepting: bool = False
    # (top-k function, caller code, whether it ranks each token's scores) seen by the mode, while learning
    topk_sites: list[tuple[Any, Any, bool]] | None = None
    held: tuple[torch.Tensor, int | None] | None = None  # recorded from the router's output as it returned (`hold`)

    @property
    def active(self) -> bool:
        """Whether any selector saw this call select its experts."""
        return any(s.active for s in self.selectors)

    def check_replayed(self) -> None:
        """Raise `ReplayError` unless the plan decided the call's experts (a replay is never a silent no-op)."""
        plan = self.plan
        if plan is None:
            return
        for s in self.selectors:
            if s.applied():
                return
        check_experts(self.layer, self.num_experts, plan)  # (the likeliest reason, named first)
        raise not_applied(self.layer, self.site.router, plan, self.step.tokens, self._seen())

    def redirected_topk(self, *args: Any, **kwargs: Any) -> Any:
        """A `torch.topk` call of the router's redirected forward (redirect.py): the first of the call's selectors
        that claims it runs it."""
        selectors = self.selectors
        if len(selectors) == 1:  # the plain top-k selector alone (a router with one top-k)
            return selectors[0].run(torch.topk, args, kwargs)
        return dispatch(self, torch.topk, args, kwargs, _inside)  # a group top-k's selector first

    def selected(self) -> tuple[torch.Tensor, torch.Tensor, int | None, bool]:
        """What the call selected (`Selector.picked`): the experts, with last dim K; what a recorder holds of them and
        their version when selected; whether they are the router's own top-k output."""
        for selector in self.selectors:
            found = selector.picked()
            if found is not None:
                return found
        raise ReplayError(
            f"could not record {self.layer!r} ({type(self.site.router).__name__}): no selection over its "
            f"E={self.num_experts} scores for each of the forward's {self.step.tokens} tokens was seen ({self._seen()})"
        )

    def _seen(self) -> str:
        return "; ".join(d for d in (s.describe() for s in self.selectors) if d)


def _inside() -> bool:
    return True  # a redirected top-k runs in the router's own forward


def check_experts(layer: str, num_experts: int | None, plan: Plan) -> None:
    """Raise `ReplayError` if the router's E (read from its logits; None: unknown) is not the routes' E. Asked of a
    replay that was not applied: a selector forces only a selection over the plan's E scores of each token, so one
    that was applied had the routes' E."""
    if num_experts is not None and num_experts != plan.num_experts:
        raise ReplayError(
            f"router {layer!r} has E={num_experts} experts but the routes hold E={plan.num_experts} for it"
        )


def not_applied(layer: str, router: torch.nn.Module, plan: Plan, tokens: int, seen: str) -> ReplayError:
    """The error of a replayed router call whose experts the plan did not decide (`seen`: what its selectors saw)."""
    return ReplayError(
        f"replay could not be applied at {layer!r} ({type(router).__name__}): the routes hold k={plan.top_k} of "
        f"E={plan.num_experts} experts for each of the forward's {tokens} tokens, but {seen}"
    )


class Recorder(Protocol):
    def record_step(self, step: Step, taken: list[tuple[str, torch.Tensor, int | None, int]]) -> None:
        """`taken`: per router call of the step, (layer, the top-k's own tensor ([B*t, K] or [B, t, K]), still the
        model's: copy what is kept, its version counter when it was selected (None: a copy already), E)."""

    def on_generate(
        self,
        streams: Iterable[int],
        sequences: torch.Tensor,
        eos: list[int],
        prompt_mask: torch.Tensor | None,
        prompt: int | None = None,
        resumed: tuple[int, torch.Tensor | None] | None = None,
    ) -> None: ...

    def drop_streams(self, first: int) -> None:
        """Forget the streams `first` and after (a `generate` that raised)."""

    def check_resume(self, stream: int) -> None:
        """Raise before a `generate` continues `stream`'s kept KV cache unless a generate of it was recorded here."""


class Replayer(Protocol):
    track_live: bool  # whether its plans count the live picks (`Plan.observe`)
    forward_check: Callable[[Any, tuple, dict], None] | None  # run before each outermost forward (steps.py)

    def plan(self, layer: str, step: Step) -> Plan | None: ...


def outputs(output: Any) -> tuple | list:
    """A module's output as a sequence (a single tensor becomes a 1-tuple)."""
    return output if isinstance(output, tuple | list) else (output,)


def num_scores(output: Any, index: int) -> int:
    """E: the last dim of the router logits, at `index` in the router's output (registered by the family)."""
    logits = output[index] if isinstance(output, (tuple, list)) else output
    return int(logits.shape[-1])


class InterceptMode(TorchFunctionMode):
    """Hands each torch function a selector of `call` intercepts to the first selector that claims it, and notes
    where each top-k was called from (redirect.py)."""

    def __init__(self, call: RouterCall, in_router: Callable[[], bool]) -> None:
        super().__init__()
        self.call, self.in_router = call, in_router

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        call, kwargs = self.call, kwargs or {}
        if func in TOPK_FUNCS and call.topk_sites is not None:  # only until redirect.py's fact is learned
            x, _, last = topk_args(args, kwargs)
            per_token = last and call.step is not None and over_each_token(x, call.step.tokens)
            call.topk_sites.append((func, caller_code(), per_token))
        return dispatch(call, func, args, kwargs, self.in_router)


def begin_call(hub: Any, session: Any, i: int) -> RouterCall:
    """Open a call of router `i` of `hub` (hub.py) in its `session` (session.py): which layer it is, which routes it
    must use, whether it is recorded.

    Example:
        >>> call = begin_call(hub, hub.session, 0)  # doctest: +SKIP
    """
    site = hub.sites[i]
    if in_backward():  # a checkpoint recompute: its plan is found when the router runs (`at_router`)
        return RouterCall(i, site, site.name, None, None, record=False, recompute=True)
    step = session.tracker.current
    if step is None:
        raise ReplayError(
            f"router {site.name!r} ran outside a forward of {type(hub.model).__name__}: call the model that was "
            "given to record_routes / replay_routes"
        )
    name = session.layer(i, step)
    plan = session.replayers[-1].plan(name, step) if session.replayers else None
    call = RouterCall(i, site, name, step, plan, record=bool(session.recorders))
    if site.router.training not in hub.facts[i].redirect:  # still to learn whether its top-k can be redirected
        call.topk_sites = []
    return call


def end_call(hub: Any, session: Any, call: RouterCall) -> None:
    """Close a router call of `hub` in its `session`: check its replay, learn facts about its router (kept by
    the hub), record its selection (held by the session for the recorders).

    Example:
        >>> end_call(hub, hub.session, call)  # doctest: +SKIP
    """
    i, router = call.index, call.site.router
    facts = hub.facts[i]
    if call.held is not None:  # recorded from the router's output
        session.taken.append((call.layer, *call.held, call.num_experts))
        return
    training, alone = router.training, hub.router_only[i]
    block_mode = call.site.scope.training  # (where the top-k runs is its block's doing: learned per block mode)
    if not alone.get(block_mode) and call.active:
        hub.learned_topk_in_router(i, block_mode, not call.outside_router and call.router_runs == 1)
    if call.topk_sites and alone.get(block_mode) and training not in facts.redirect:
        # a redirected forward hands its torch.topk calls to the selectors: each must be one it may carry
        carried = bool(call.selectors) and all(s.carried_by_redirect for s in call.selectors)
        facts.redirect[training] = redirectable(router, call.topk_sites) if carried else 0
    call.check_replayed()
    if not call.record:
        return
    idx, held, version, own_output = call.selected()
    if own_output and call.router_out is not None and training not in facts.output_index:
        # later calls read the router's output only if it held what the top-k selected (a class that edits them in
        # place before returning them is always intercepted, and the edit refused when they are copied)
        kept = idx._version == version if version is not None else torch.equal(held, idx)  # (once per router)
        facts.output_index[training] = next(
            (j for j, o in enumerate(outputs(call.router_out)) if o is idx and kept), None
        )
    session.taken.append((call.layer, held, version, call.num_experts))

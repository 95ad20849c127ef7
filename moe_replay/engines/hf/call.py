"""One router call (`RouterCall`): which layer and positions it is, which routes it must use, what its selectors saw;
`InterceptMode`, which hands its torch functions to them; what a context gives the hooks (`Recorder`, `Replayer`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from ...errors import ReplayError
from .discover import RouterSite
from .plan import Plan
from .selectors import Selector, dispatch
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

    def selected(self) -> tuple[torch.Tensor, int | None]:
        """What the call selected (`Selector.picked`): the experts (last dim K) as a recorder holds them, and their
        version when selected."""
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
    """Hands each torch function of a router call (its router's forward, or its MoE block's) to the first of the
    call's selectors that claims it (selectors.py)."""

    def __init__(self, call: RouterCall) -> None:
        super().__init__()
        self.call = call

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return dispatch(self.call, func, args, kwargs or {})

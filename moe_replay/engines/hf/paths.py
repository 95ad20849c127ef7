"""Which path a router call takes: the Hugging Face engine's one table (docs/design.md follows each path file by file).

Every fact these rows read is the router's own, for the training mode it runs in (facts.py): "alone" is a router whose
top-k ran inside itself in every call seen with its MoE block in the block's mode (`RouterFacts.topk_in_router`,
`hub.router_only`). A block is wrapped until its router is alone in both modes (then `hub.unwrapped`); its wrapper
asks `before_block`:

    situation of the MoE block's forward                                               path
    ---------------------------------------------------------------------------------  ----------------------------
    no call of its router open, and its router alone                                    PASS   (run as is)
    anything else                                                                       CALL   (call.py, below)

A router's wrapper (wrapper.py) asks `before_call` first; the first row that holds decides:

    situation of the router's forward                                                  path
    ---------------------------------------------------------------------------------  ----------------------------
    a backward (checkpoint recompute), no tracked forward running, or a call already   CALL   (call.py, below)
      opened by its MoE block
    recording alone; it returns its top-k's indices (`RouterFacts.output_index`,        READ   (wrapper.read_output)
      `hub.record_from`), and it is alone
    replay alone; its one top-k over each token's scores is a `torch.topk` written in   LANE   (lane.lane_path)
      its own forward (`RouterFacts.redirect == 1`), it is alone, no live tally and no
      recompute to come (`lane_ready`)
    anything else                                                                       CALL

A CALL is one `RouterCall`, opened by whichever of the router and its MoE block runs first. `in_call` then decides,
for each of the two wrappers that runs inside it:

    situation inside the call                                                          path
    ---------------------------------------------------------------------------------  ----------------------------
    the router, alone, recorded only, not a recompute, it returns its top-k's indices   HOLD      (the output, as is)
    the call already intercepts (the block's mode is on), or this is the block of a    AS_IS
      router alone
    the router, alone, its top-k calls all `torch.topk` in its own forward             REDIRECT  (redirect.py)
    anything else                                                                       MODE      (call.InterceptMode)

`MOE_REPLAY_PATH=general` (read when an outermost context installs its hooks) wraps every MoE block and takes none of
PASS, READ, LANE, HOLD and REDIRECT: every call runs under the `TorchFunctionMode`, the path that needs no learned
fact (the tests run the families both ways). What these rows read is set by the hub (hub.py) and its session
(session.py), and learned in end_call (call.py); the paths themselves test none of it again.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .lane import lane_ready
from .steps import Step

ENV = "MOE_REPLAY_PATH"
CHOICES = ("auto", "general")
PASS, READ, LANE, CALL = "pass", "read", "lane", "call"  # before a call opens
HOLD, AS_IS, REDIRECT, MODE = "hold", "as is", "redirect", "mode"  # inside a call
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward (as `autograd.in_backward` reads it)


def general_path() -> bool:
    """Whether `MOE_REPLAY_PATH` asks for the general path only (`general`) or lets the table choose (`auto`, unset).

    Example:
        >>> general_path()  # MOE_REPLAY_PATH unset
        False
    """
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(CHOICES)}")
    return value == "general"


def before_block(hub: Any, session: Any, i: int, block: nn.Module) -> str:
    """The path of a forward of router `i`'s MoE block `block`: PASS or CALL (the first table above).

    Example:
        >>> before_block(hub, hub.session, 0, block)  # doctest: +SKIP
        'pass'
    """
    return PASS if session.calls[i] is None and hub.router_only[i].get(block.training) else CALL


def before_call(hub: Any, session: Any, i: int, router: nn.Module, step: Step | None, redirectable: bool) -> str:
    """The path of a forward of router `i` of `hub` (hub.py) in `step` of its `session` (session.py): READ, LANE or
    CALL (the second table above).
    `redirectable`: the hub has a redirected copy of the router's forward (redirect.py).

    Example:
        >>> before_call(hub, hub.session, 0, router, hub.session.tracker.current, True)  # doctest: +SKIP
        'lane'
    """
    if step is None or session.calls[i] is not None or _graph_task() != -1:
        return CALL
    if not hub.unwrapped[i] and not hub.router_only[i].get(hub.sites[i].scope.training):  # (alone: its block's mode)
        return CALL
    training = router.training
    index = hub.record_from[i]  # (None unless the open contexts only record)
    if index is not None:
        return CALL if index.get(training) is None else READ
    if (  # (the hooks are set only while a context is open: no recorder means a replayer)
        redirectable
        and not session.recorders
        and hub.facts[i].redirect.get(training, 0) == 1
        and (step is session.lane_step or lane_ready(session, step))
    ):
        return LANE
    return CALL


def in_call(hub: Any, session: Any, call: Any, router: nn.Module, is_router: bool, redirectable: bool) -> str:
    """The path of the router's forward (`is_router`) or its MoE block's inside `call` (call.py): HOLD, AS_IS,
    REDIRECT or MODE (the third table above). `redirectable` as for `before_call`.

    Example:
        >>> in_call(hub, hub.session, call, router, True, True)  # doctest: +SKIP
        'redirect'
    """
    i = call.index
    alone = hub.unwrapped[i] or hub.router_only[i].get(call.site.scope.training)  # (never under general)
    if is_router and alone and call.plan is None and not call.recompute and session.reads_output(i, router):
        if hub.facts[i].output_index.get(router.training) is not None:
            return HOLD
    if call.intercepting or (alone and not is_router):
        return AS_IS
    if redirectable and is_router and alone and hub.facts[i].redirect.get(router.training, 0):
        return REDIRECT
    return MODE

"""How the engines tell one activation checkpoint from another (`engines/autograd.py`), against the installed torch.

No public torch API names the checkpoint being recomputed, so the engines read torch's own frames: a non-reentrant
checkpoint's `_CheckpointFrame` (from its saved-tensor hooks and from the generator its call holds) and a reentrant
one's autograd node. These tests pin that reading down on every checkpoint nesting, so that a torch release that moves
it fails here, by name, rather than as a refusal in a user's training step (torch 2.14 moved the non-reentrant
call's generator from `checkpoint` into `_checkpoint_impl`: the outer checkpoint of a nested pair was lost)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe_replay.engines.autograd import checkpoint_chain, in_backward, recomputing, within

KINDS = ("reentrant", "non_reentrant")


@pytest.mark.parametrize("outer", [None, *KINDS])
@pytest.mark.parametrize("inner", KINDS)
def test_every_checkpoint_around_a_call_is_found_and_its_recompute_named(outer, inner):
    chains, recomputes = [], []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if in_backward():
            recomputes.append(recomputing())
        else:
            chains.append(checkpoint_chain())
        return x.sin().cos()

    def inner_call(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(fn, x, use_reentrant=inner == "reentrant")

    x = torch.randn(4, requires_grad=True)
    y = inner_call(x) if outer is None else checkpoint(inner_call, x, use_reentrant=outer == "reentrant")
    assert len(chains) == 1 and not recomputes
    chain = chains[0]
    assert len(chain) == (1 if outer is None else 2), f"torch {torch.__version__}: checkpoints found {len(chain)}"
    y.sum().backward()
    assert recomputes, "fn was not recomputed in the backward"
    # the first recompute is the outermost checkpoint's (a nested one then runs its first forward again inside it, and
    # its own recompute is named by the chain taken there: the recompute queues add it, recompute.py)
    assert within(chain, recomputes[0]), f"torch {torch.__version__}: the recompute is not named by its chain"
    assert recomputing() is None and checkpoint_chain() == ()


def test_two_forwards_of_one_checkpointed_function_are_told_apart():
    """The case the recompute queues rely on: identical inputs, two checkpoints, each recompute named by its own."""
    chains, recomputes = [], []

    def fn(x: torch.Tensor) -> torch.Tensor:
        (recomputes if in_backward() else chains).append(recomputing() if in_backward() else checkpoint_chain())
        return x.exp()

    x = torch.ones(3, requires_grad=True)
    a, b = checkpoint(fn, x, use_reentrant=False), checkpoint(fn, x, use_reentrant=False)
    b.sum().backward(retain_graph=True)
    assert [within(chains[1], r) for r in recomputes] == [True] and not within(chains[0], recomputes[0])
    a.sum().backward()
    assert within(chains[0], recomputes[1]) and not within(chains[1], recomputes[1])

"""The hub's queues of replayed calls that the backward will recompute (recompute.py): a context closed before its
backward is refused, and what a context queued leaves with it, so the model's kept hub starts the next one empty."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded, perturb, recorded, tiny_qwen3_moe

from moe_replay import ReplayError, replay_routes
from moe_replay.engines.hf.layout import model_layout


def checkpointed(reentrant: bool):  # noqa: ANN201
    """A tiny model whose routers moved since its routes were recorded, in train mode with transformers' gradient
    checkpointing, with its inputs and routes."""
    model = tiny_qwen3_moe()
    ids, mask = left_padded(2, 6, [0, 1])
    routes = recorded(model, ids, mask)
    perturb(model)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model, ids, mask, routes


def router_grads(model, ids, mask, routes) -> list[torch.Tensor]:  # noqa: ANN001
    """The router weights' gradients of one replayed forward and backward."""
    model.zero_grad(set_to_none=True)
    with replay_routes(model, routes):
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    return [s.router.weight.grad.clone() for s in model_layout(model).sites]


def queues_empty(model) -> bool:  # noqa: ANN001
    return all(queue.empty for queue in model_layout(model).kept["hub"].pending)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_context_closed_before_the_backward_of_a_checkpointed_forward_is_an_error(reentrant):
    """The recompute in the backward needs the context open: closing it first raises, naming the calls still waiting;
    the next context (on the model's kept hub) starts with nothing waiting and replays its own backward's recompute."""
    model, ids, mask, routes = checkpointed(reentrant)
    expected = router_grads(model, ids, mask, routes)
    with pytest.raises(ReplayError, match=r"\d+ replayed router calls still wait for their recompute"):
        with replay_routes(model, routes):
            model(ids, attention_mask=mask, labels=ids, use_cache=False)
    assert queues_empty(model)  # its calls left with it
    got = router_grads(model, ids, mask, routes)
    assert all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_calls_a_context_queued_leave_with_it(reentrant):
    """The recomputed calls kept for a second backward (retain_graph) belong to their context: a nested replay's leave
    as it closes, while the outer context stays open, and the outer's as it closes (found by review: no test failed
    when they stayed)."""
    model, ids, mask, routes = checkpointed(reentrant)
    with replay_routes(model, routes):
        with replay_routes(model, routes):
            model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward(retain_graph=True)
            assert not queues_empty(model)  # kept for a second backward
        assert queues_empty(model)
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward(retain_graph=True)
        assert not queues_empty(model)
    assert queues_empty(model)

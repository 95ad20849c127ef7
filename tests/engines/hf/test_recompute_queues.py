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


@pytest.mark.parametrize("reentrant", [True, False])
def test_recomputes_of_batches_of_64_that_share_their_first_token_take_their_own_plans(reentrant):
    """Two forwards of 64 rows each that share their first token, under nested replays of their own routes, then one
    backward: each recompute takes its forward's plan. Elements evenly spaced over such an input fell on each row's
    first position, alike in both forwards, so the recompute was refused as matching both (found by review)."""
    model = tiny_qwen3_moe()
    a, _ = left_padded(64, 5, [0] * 64, seed=1)
    b, _ = left_padded(64, 5, [0] * 64, seed=2)
    a[:, 0] = b[:, 0] = 3  # a BOS token
    ones = torch.ones_like(a)
    ra, rb = recorded(model, a, ones), recorded(model, b, ones)
    perturb(model)
    model.train()
    alone = [router_grads(model, x, ones, r) for x, r in ((a, ra), (b, rb))]  # each forward and backward alone
    expected = [g1 + g2 for g1, g2 in zip(*alone, strict=True)]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.zero_grad(set_to_none=True)
    with replay_routes(model, ra):
        loss = model(a, labels=a, use_cache=False).loss
        with replay_routes(model, rb):
            (loss + model(b, labels=b, use_cache=False).loss).backward()
    got = [s.router.weight.grad for s in model_layout(model).sites]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)

"""Where the backward of a checkpointed, replayed forward runs: after its context closed it is refused (the
context's exit says to call loss.backward() inside it), and the forwards of nested contexts, of different shapes and
each backwarded inside its own context, get the gradients they get without checkpointing."""

from __future__ import annotations

import pytest
import torch
from helpers import hook_count, left_padded, perturb, recorded, tiny_qwen3_moe

from moe_replay import ReplayError, replay_routes


def test_checkpointed_backward_outside_the_context_is_refused(qwen):
    ids, mask = left_padded(2, 6, [0, 1])
    routes = recorded(qwen, ids, mask)
    qwen.train()
    qwen.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    before = hook_count(qwen)  # transformers adds an input hook for reentrant checkpointing
    with pytest.raises(ReplayError, match=r"call loss.backward\(\) inside"):
        with replay_routes(qwen, routes):
            loss = qwen(ids, attention_mask=mask, labels=ids).loss
    assert hook_count(qwen) == before
    with torch.no_grad(), replay_routes(qwen, routes):  # no backward coming: nothing waits, no error
        qwen(ids, attention_mask=mask)
    del loss


def test_accumulating_differently_shaped_forwards_under_checkpointing():
    model = tiny_qwen3_moe()
    a_ids, a_mask = left_padded(2, 6, [0, 1], seed=1)
    b_ids, b_mask = left_padded(3, 9, [2, 0, 0], seed=2)
    ra, rb = recorded(model, a_ids, a_mask), recorded(model, b_ids, b_mask)
    perturb(model)
    model.train()

    def grads(checkpointing):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad(set_to_none=True)
        with replay_routes(model, ra):
            la = model(a_ids, attention_mask=a_mask, labels=a_ids).loss
            with replay_routes(model, rb):  # the inner context replays rb; both backwards run inside their contexts
                lb = model(b_ids, attention_mask=b_mask, labels=b_ids).loss
                lb.backward()
            la.backward()
        model.gradient_checkpointing_disable()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, ckpt = grads(False), grads(True)
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-7)

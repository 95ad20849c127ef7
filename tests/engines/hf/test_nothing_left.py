"""Nothing of moe-replay stays on a model once its last context (and any `keep_warm` scope) has closed: every
submodule holds what a twin that ran the same calls without moe-replay holds, after exceptions, copies, saves,
nesting and scopes closed out of order; and what a `keep_warm` scope keeps is shared by nested scopes and never
copied or saved with the model."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import left_padded, perturb, tiny_qwen3_moe
from torch import nn

from moe_replay import ReplayError, keep_warm, record_routes, replay_routes


def summary(value: object) -> object:
    """What a module attribute holds, comparable across two models (hook handles are numbered globally)."""
    if isinstance(value, dict):
        keys = list(value)
        return (type(value).__name__, keys if all(isinstance(k, str) for k in keys) else len(keys))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    return type(value).__name__


def snapshot(model: nn.Module) -> dict[str, dict[str, object]]:
    """`vars()` of every submodule by name, summarised."""
    return {name: {k: summary(v) for k, v in vars(m).items()} for name, m in model.named_modules()}


def twins() -> tuple[nn.Module, nn.Module]:
    model = tiny_qwen3_moe()
    return model, copy.deepcopy(model)


def run_plain_and_hooked(model: nn.Module, twin: nn.Module) -> None:
    """The same calls on both models: `model` under moe-replay contexts (some of them failing), `twin` without."""
    ids, mask = left_padded(2, 6, [0, 1])
    with torch.no_grad(), record_routes(model) as rec:
        model(ids, attention_mask=mask)
    twin(ids, attention_mask=mask)
    routes = rec.routes

    with replay_routes(model, routes), record_routes(model):  # nested, with a backward
        model(ids, attention_mask=mask).logits.sum().backward()
    twin(ids, attention_mask=mask).logits.sum().backward()

    with pytest.raises(RuntimeError, match="user code"), replay_routes(model, routes):
        copy.deepcopy(model)  # a copy made inside a context
        torch.save(model, io.BytesIO())  # and a save
        model(ids, attention_mask=mask)
        raise RuntimeError("user code")
    twin(ids, attention_mask=mask)

    longer, longer_mask = left_padded(2, 7, [0, 1])
    with pytest.raises(ReplayError), replay_routes(model, routes):  # routes for 6 positions, a forward of 7
        model(longer, attention_mask=longer_mask)
    twin(longer, attention_mask=longer_mask)

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train(), twin.train()
    with replay_routes(model, routes):
        model(ids, attention_mask=mask, use_cache=False).logits.sum().backward()
    twin(ids, attention_mask=mask, use_cache=False).logits.sum().backward()
    model.gradient_checkpointing_disable(), twin.gradient_checkpointing_disable()
    model.eval(), twin.eval()

    with torch.no_grad(), record_routes(model):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        twin.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_no_context_leaves_anything_on_the_model():
    model, twin = twins()
    run_plain_and_hooked(model, twin)
    assert snapshot(model) == snapshot(twin)


def test_a_keep_warm_scope_leaves_nothing_once_closed_even_before_its_contexts():
    model, twin = twins()
    with keep_warm(model), keep_warm(model):  # nested: the inner shares the outer's state
        run_plain_and_hooked(model, twin)
    assert snapshot(model) == snapshot(twin)

    ids, mask = left_padded(2, 6, [0, 1])
    scope = keep_warm(model)
    scope.__enter__()
    context = record_routes(model)
    context.__enter__()
    scope.__exit__(None, None, None)  # closed out of order (an ExitStack unwinding another way): the context goes on
    with torch.no_grad():
        model(ids, attention_mask=mask)
    context.__exit__(None, None, None)
    twin(ids, attention_mask=mask)
    assert context.routes.shape[:2] == (2, 6)
    assert snapshot(model) == snapshot(twin)


def test_a_scope_keeps_what_contexts_learned_and_shares_it_with_nested_scopes():
    model = tiny_qwen3_moe()
    ids, mask = left_padded(2, 6, [0, 1])
    with keep_warm(model) as outer:
        with torch.no_grad(), record_routes(model):
            model(ids, attention_mask=mask)
        learned = outer.facts
        assert len(learned) == 2  # two routers
        with keep_warm(model) as inner:
            assert inner.facts == learned and inner.warm is outer.warm
        clone = copy.deepcopy(model)  # a copy or a save made inside the scope carries none of it
        buffer = io.BytesIO()
        torch.save(model, buffer)
        assert outer.facts == learned  # the inner scope's close dropped nothing
    plain = tiny_qwen3_moe()
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert snapshot(clone) == snapshot(plain) == snapshot(loaded)
    with pytest.raises(RuntimeError, match="read inside the scope"):
        _ = outer.facts


def test_keep_warm_refuses_to_open_inside_a_context_and_takes_only_a_module():
    model = tiny_qwen3_moe()
    with record_routes(model), pytest.raises(ReplayError, match="open the scope around the contexts"):
        keep_warm(model).__enter__()
    with pytest.raises(ValueError, match="got list"):
        keep_warm([model])


def test_replays_inside_and_outside_a_scope_are_identical():
    """The scope changes what is kept between contexts, never what a context does."""
    model = tiny_qwen3_moe()
    ids, mask = left_padded(3, 7, [0, 2, 1])
    with torch.no_grad(), record_routes(model) as rec:
        model(ids, attention_mask=mask)
    perturb(model)
    grads = []
    for scoped in (False, True, True):
        model.zero_grad()
        with keep_warm(model) if scoped else torch.enable_grad():
            for _ in range(2):
                with replay_routes(model, rec.routes):
                    out = model(ids, attention_mask=mask).logits
                    out.square().mean().backward()
        grads.append((out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    for out, grad in grads[1:]:
        assert torch.equal(out, grads[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grad, grads[0][1], strict=True))

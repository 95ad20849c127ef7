"""Nothing of moe-replay stays on a model once its last context has closed: every submodule holds what a twin that
ran the same calls without moe-replay holds, after exceptions, copies, saves and nesting, on either path; and the
deprecated `keep_warm` scope changes nothing."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from helpers import left_padded, tiny_qwen3_moe
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


def test_no_context_leaves_anything_on_the_model(path):
    model, twin = twins()
    run_plain_and_hooked(model, twin)
    assert snapshot(model) == snapshot(twin)


def test_keep_warm_is_a_deprecated_no_op_that_still_takes_only_a_module():
    """`keep_warm` warns DeprecationWarning, and contexts inside it, opened or closed in any order, do and leave
    what they do without it."""
    model, twin = twins()
    with pytest.warns(DeprecationWarning, match="keep_warm is deprecated"):
        scope = keep_warm(model)
    with scope:
        run_plain_and_hooked(model, twin)
    assert snapshot(model) == snapshot(twin)
    ids, mask = left_padded(2, 6, [0, 1])
    with pytest.warns(DeprecationWarning):
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
    with pytest.raises(ValueError, match="got list"), pytest.warns(DeprecationWarning):
        keep_warm([model])
